"""ds4c's step IR: graph data structures, op registry, builder, verifier, printer, exports, interpreter."""

from ds4c.ir.builder import build_step
from ds4c.ir.graph import Graph, Op, Sym, TensorType, Value
from ds4c.ir.interpreter import Interpreter, run_split_step, run_step
from ds4c.ir.printer import graph_hash, print_graph
from ds4c.ir.verify import VerifyError, verify

__all__ = ["Graph", "Op", "Sym", "TensorType", "Value", "build_step", "Interpreter", "run_step", "run_split_step", "print_graph",
           "graph_hash", "verify", "VerifyError"]
