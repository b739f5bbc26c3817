"""The MLX backend: mlx-lm models as the loop's target (target.py), the device-side acceptance
rules, the tree pass, the recurrent state tape, hidden-state capture and early exit.

Its `Backend` record is built in mlxspec.backends; importing this package imports nothing else,
so a drafter can take one part (hidden_states, sampling) without the target.
"""
