"""GPU correctness and timing checks per kernel family (run on a CUDA machine by tools/gpu_kernel_check.py)."""
