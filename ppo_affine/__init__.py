"""The engine the programs at the repository root are built from: PPO math, experience, the update,
rollouts, generation backends, the policy, checkpoints, ranks, the run log, and the environments."""
