"""Environment backends behind one OpenEnv-shaped interface (see envs/base.py)."""
