"""The eager PyTorch reference of DeepSeek-V4-Flash (docs/model.md sections 3-6): the oracle every
other implementation is checked against. Readable, not fast."""

from ds4c.reference.model import MAX_WIDTH, Reference
from ds4c.reference.sharded import ShardedReference
from ds4c.reference.state import SequenceState
from ds4c.reference.weights import ReferenceWeights

__all__ = ["MAX_WIDTH", "Reference", "ReferenceWeights", "SequenceState", "ShardedReference"]
