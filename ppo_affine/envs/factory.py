"""Build the configured environments: embedded in-process, or affinetes (docker / url)."""
from __future__ import annotations

from typing import Callable

from ppo_affine.envs.base import Env
from ppo_affine.envs.tasks import game_name_of


def make_env(spec, seed: int) -> Env:
    """One env backend from an `EnvSpec` (utils.py)."""
    if spec.mode in ("docker", "url"):
        from ppo_affine.envs.affinetes_env import AffinetesEnv

        return AffinetesEnv(
            mode=spec.mode, base_url=spec.url, image=spec.image, env_vars=spec.env_vars, replicas=spec.replicas,
            call_timeout=spec.timeout, max_retries=spec.retries,
        )
    if spec.kind == "openspiel":
        from ppo_affine.envs.openspiel_env import OpenSpielEnv

        return OpenSpielEnv(observation_format=spec.observation_format, seed=seed,
                            mcts_simulations=spec.mcts_simulations, workers=spec.workers)
    from ppo_affine.envs.trace_env import TraceEnv

    return TraceEnv(source=spec.source, skip_degenerate=spec.skip_degenerate, timeout=spec.execution_timeout,
                    seed=seed, unsafe_rlimit_only_sandbox=spec.unsafe_rlimit_only_sandbox)


def make_envs(env_config, seed: int) -> dict[str, tuple[str, Env]]:
    return {name: (spec.kind, make_env(spec, seed)) for name, spec in env_config.envs.items()}


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
