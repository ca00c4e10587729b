"""CPU emulators of the rendered kernels (no GPU): each compiles a family's CUDA body as host C++20 on a host
prelude in which every GPU thread of a block is a fiber (``experts_emu``) and runs it, so the family tests can
compare the kernel's own logic with the family's CPU reference. The tests import them as ``emulators.<name>``
(tests/ is on ``sys.path`` under pytest); each also runs by hand: ``python tests/emulators/<name>.py``."""
