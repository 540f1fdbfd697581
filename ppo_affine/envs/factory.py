"""Build the configured environments: embedded in-process, or affinetes (docker / url)."""
from __future__ import annotations

import os
from typing import Callable

from ppo_affine.envs.base import Env
from ppo_affine.envs.tasks import game_name_of


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity, which container limits narrow)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def game_workers(spec, meets_search: bool, ranks_on_machine: int = 1) -> int:
    """Worker processes for an embedded game env: `auto` shares the machine's cores among its ranks, but only
    for runs with an MCTS opponent (a worker imports the trainer's libraries again: ~0.5 GB and seconds)."""
    if spec.workers != "auto":
        return spec.workers
    return max(1, usable_cores() // ranks_on_machine) if meets_search else 0


def make_env(spec, seed: int, meets_search: bool = True, ranks_on_machine: int = 1) -> Env:
    """One env backend from an `EnvSpec` (ppo_affine/config.py); `meets_search`: whether an MCTS opponent will play."""
    if spec.mode in ("docker", "url"):
        from ppo_affine.envs.affinetes_env import AffinetesEnv

        return AffinetesEnv(
            mode=spec.mode, base_url=spec.url, image=spec.image, env_vars=spec.env_vars, replicas=spec.replicas,
            call_timeout=spec.timeout, max_retries=spec.retries, server_wait_seconds=spec.server_wait_seconds,
            hosts=spec.hosts,
        )
    if spec.kind == "openspiel":
        from ppo_affine.envs.openspiel_env import OpenSpielEnv

        return OpenSpielEnv(observation_format=spec.observation_format, seed=seed,
                            mcts_simulations=spec.mcts_simulations, opponent_search=spec.opponent_search,
                            opponent_moves=spec.opponent_moves,
                            workers=game_workers(spec, meets_search, ranks_on_machine))
    from ppo_affine.envs.trace_env import TraceEnv

    return TraceEnv(source=spec.source, skip_degenerate=spec.skip_degenerate, timeout=spec.execution_timeout,
                    seed=seed, unsafe_rlimit_only_sandbox=spec.unsafe_rlimit_only_sandbox)


def make_envs(env_config, seed: int, meets_search: bool = True, ranks_on_machine: int = 1) -> dict[str, tuple[str, Env]]:
    return {name: (spec.kind, make_env(spec, seed, meets_search, ranks_on_machine))
            for name, spec in env_config.envs.items()}


def playable_filter(env_config) -> Callable[[str, int], bool]:
    """Which task ids the curriculum may sample: loadable games, inside each env's game allow-list."""
    from ppo_affine.envs.games import is_playable  # no pyspiel import needed to filter tasks

    def playable(env_name: str, task_id: int) -> bool:
        spec = env_config.envs[env_name]
        if spec.kind != "openspiel":
            return True
        if spec.games is not None and game_name_of(task_id) not in spec.games:
            return False
        return is_playable(task_id)

    return playable
