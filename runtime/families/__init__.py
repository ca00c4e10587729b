"""Kernel families: render parameters, launch shapes, argument orders and CPU references per fused op."""
