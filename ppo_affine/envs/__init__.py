"""Environment backends behind one OpenEnv-shaped interface (see ppo_affine/envs/base.py)."""
