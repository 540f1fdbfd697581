"""The SFT of the warm start: recorded conversations become token sequences exactly as a rollout builds them, and
the LoRA adapter learns the assistant replies (masked negative log-likelihood), saved as a checkpoint PPO starts
from."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ppo_affine.config import Config, ConfigError
from ppo_affine.run_log import console, rollout_progress
from ppo_affine.warm_start.config import WarmStartConfig

SFT_STATE_KIND = "sft-warmstart"  # the checkpoint kind of its checkpoints (checkpoint.checkpoint_kind)


def read_records(path: Path, option: str = "--data") -> list[dict[str, Any]]:
    """The conversations of a JSONL file (sft_data.jsonl's shape); ConfigError naming `option` otherwise."""
    try:
        records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{option} {path}: cannot read conversations ({exc}).") from None
    if not records or not all(isinstance(r.get("messages"), list) for r in records):
        raise ConfigError(f"{option} {path}: expected JSONL lines with a 'messages' list (as sft_data.jsonl holds).")
    for number, record in enumerate(records, 1):
        refuse_evaluation_game(record, f"{option} {path} line {number}")
    return records


def refuse_evaluation_game(record: dict[str, Any], where: str) -> None:
    """A ConfigError when `record` is a game on an evaluation seed (the validators' or bench/learning.py's
    held-out ones): SFT or DAgger on it would train on the deals and opponent moves the results are judged on."""
    from ppo_affine.envs.tasks import game_name_of, is_evaluation_seed, is_held_out_trace_task
    from ppo_affine.envs.trace_programs import repeats_a_held_out_program

    task_id, seed = record.get("task_id"), record.get("seed")
    if record.get("env") == "trace" and isinstance(task_id, int) and is_held_out_trace_task(task_id):
        raise ConfigError(f"{where}: trace task {task_id} is a held-out task (evaluate.py's and the benches'); "
                          "training on it would train on the test.")
    if record.get("env") == "trace" and isinstance(task_id, int) and repeats_a_held_out_program(task_id):
        raise ConfigError(f"{where}: trace task {task_id}'s program is a held-out task's program under another id; "
                          "training on it would train on the test.")
    if record.get("env", "openspiel") != "openspiel" or not isinstance(task_id, int) or not isinstance(seed, int):
        return
    try:
        game = record.get("game") or game_name_of(task_id)
    except ValueError:
        return
    if is_evaluation_seed(game, task_id, seed):
        raise ConfigError(f"{where}: {game} task {task_id} seed {seed} is an evaluation seed (the validators' or "
                          "bench/learning.py's held-out games); training on it would train on the test. Play "
                          "games on seeds of their own to relabel (evaluate.py --seed S).")


def conversations_to_episodes(records: list[dict[str, Any]], builder, strategy: str, eos_ids: set[int]):
    """Rollout-shaped episodes (token sequences + turns) of recorded conversations, built the way a rollout
    prompts: the same context strategy, and each reply's ids followed by an EOS. A record's
    `explored_replies` (random moves) stay in the context and are not trained on."""
    from ppo_affine.envs.tasks import Task
    from ppo_affine.prompts import TokenHistory
    from ppo_affine.rollout import Episode, Turn, build_messages

    eos = builder.tokenizer.eos_token_id  # the token that ends an assistant turn in the chat template
    episodes = []
    for record in records:
        messages = record["messages"]
        explored = set(record.get("explored_replies", ()))
        replies_seen = 0
        has_system = bool(messages) and messages[0]["role"] == "system"
        history = TokenHistory(builder, eos_ids)
        kind = record.get("env", "openspiel")
        episode = Episode(task=Task(kind, record.get("task_id", 0), record.get("seed", 0), None, "sft", False),
                          env_kind=kind, sequences=history.sequences, game_name=record.get("game", ""),
                          done=True, score=float(record.get("score") or 0.0))  # None: a cut record
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            shown = build_messages(messages[:i], i - 1, strategy, None)
            prompt = history.prompt(shown, i - 1 if strategy != "last" else int(has_system))
            if prompt is None:
                break  # longer than generation.max_prompt_tokens: the rest of this game is not trained on
            _, sequence, start = prompt
            reply_ids = builder.tokenize(message["content"]) + [eos]
            history.add_reply(reply_ids, message["content"])
            if replies_seen not in explored:  # a random move stays in the context, untrained
                episode.turns.append(Turn(reply_ids, message["content"], None, sequence=sequence, start=start))
            replies_seen += 1
        episodes.append(episode)
    return episodes


def train_sft(policy, sequences, epochs: int, learning_rate: float, batch_size: int, token_budget: int,
              seed: int, max_grad_norm: float = 1.0, trees: str = "off") -> list[dict[str, float]]:
    """Masked SFT: minibatches of `batch_size` sequences, micro-batches by `token_budget`; per-epoch stats.

    `trees` (`ppo.tree_scoring`), unless "off": the conversations are shuffled and each keeps its sequences
    together, in order, so that a minibatch's sequences of one conversation (its turns after stripped reasoning)
    can run as one prefix tree (`batching.scoring_sequences`). The number of sequences per optimizer step is the
    same as without, and where every conversation is one sequence (no reasoning stripped) so is the order."""
    import torch

    from ppo_affine.batching import micro_batches, scoring_sequences
    from ppo_affine.experience import batch_cost

    optimizer = torch.optim.AdamW(policy.adapter_parameters(), lr=learning_rate, weight_decay=0.0)
    order_rng = torch.Generator().manual_seed(seed)
    pad_id = policy.tokenizer.pad_token_id
    by_conversation: dict[int, list[int]] = {}
    for index, sequence in enumerate(sequences):
        by_conversation.setdefault(sequence.episode, []).append(index)
    conversations = list(by_conversation.values())
    policy.train()
    history = []
    steps = 0
    for epoch in range(epochs):
        if trees != "off":
            order = [index for c in torch.randperm(len(conversations), generator=order_rng).tolist()
                     for index in conversations[c]]
        else:
            order = torch.randperm(len(sequences), generator=order_rng).tolist()
        total_loss = total_tokens = 0.0
        processed = 0  # tokens through the model (padding included, a shared prefix counted once)
        batches = (len(order) + batch_size - 1) // batch_size
        with rollout_progress(batches, f"SFT epoch {epoch + 1}/{epochs}") as advance:
            for first in range(0, len(order), batch_size):
                minibatch = [sequences[i] for i in order[first:first + batch_size]]
                minibatch = scoring_sequences(minibatch, token_budget, trees)
                tokens = sum(s.response_len for s in minibatch)
                optimizer.zero_grad(set_to_none=True)
                for batch in micro_batches(minibatch, token_budget, pad_id, policy.device,
                                           policy.shares_prefixes_with_gradients()):
                    processed += batch_cost(batch.input_ids, batch.tree)
                    scored = policy.score(batch.input_ids, None, batch.response_mask, tree=batch.tree,
                                          with_values=False)
                    loss = -(scored.logprobs * batch.response_mask).sum() / tokens
                    loss.backward()
                    total_loss += loss.item() * tokens
                torch.nn.utils.clip_grad_norm_(policy.adapter_parameters(), max_grad_norm)
                optimizer.step()
                steps += 1
                total_tokens += tokens
                advance()
        history.append({"epoch": epoch + 1, "loss": total_loss / max(1.0, total_tokens), "optimizer_steps": steps,
                        "tokens_processed": processed})
        console.print(f"SFT epoch {epoch + 1}: mean NLL per reply token {history[-1]['loss']:.4f}", highlight=False)
    optimizer.zero_grad(set_to_none=True)
    policy.eval()
    return history


def fine_tune(config: Config, records: list[dict[str, Any]], settings: WarmStartConfig, init_adapter: Path | None,
              output_dir: Path) -> Path:
    """SFT on `records` (from the adapter at `init_adapter`, else a fresh LoRA) for `settings.epochs`, then a
    checkpoint in `output_dir/checkpoints` that keeps `config` and `settings`; returns its path."""
    import torch

    from ppo_affine.allocator import return_freed_memory_to_the_os, training_allocations
    from ppo_affine.architectures import tree_scoring_mode
    from ppo_affine.batching import build_sequences
    from ppo_affine.checkpoint import save_checkpoint
    from ppo_affine.generation import eos_token_ids
    from ppo_affine.model_files import pick_device
    from ppo_affine.policy import adapter_folder, load_policy
    from ppo_affine.prompts import PromptBuilder

    cfg = config.train
    device = pick_device(cfg.run.device)
    return_freed_memory_to_the_os()
    torch.manual_seed(cfg.run.seed)
    policy = load_policy(cfg.model, cfg.lora, device)
    if init_adapter is not None:
        policy.load_adapter(adapter_folder(init_adapter))
        console.print(f"SFT goes on from the adapter in {init_adapter}", highlight=False)
    builder = PromptBuilder(policy.tokenizer, cfg.generation.max_prompt_tokens, cfg.model.chat_template_kwargs)
    episodes = conversations_to_episodes(records, builder, cfg.generation.context_strategy,
                                         eos_token_ids(policy.tokenizer, policy.model.generation_config))
    sequences = build_sequences(episodes)
    if not sequences:
        raise ConfigError("no expert reply to train on: each was a random move (--explore) or its prompt is longer "
                          "than generation.max_prompt_tokens.")
    console.print(f"SFT on {sum(len(e.turns) for e in episodes)} expert replies in {len(sequences)} sequences "
                  f"({sum(s.response_len for s in sequences)} reply tokens)", highlight=False)
    with training_allocations():
        history = train_sft(policy, sequences, settings.epochs, settings.learning_rate, settings.batch_size,
                            cfg.ppo.micro_batch_tokens, cfg.run.seed,
                            trees=tree_scoring_mode(policy.model.config, cfg.ppo.tree_scoring))
    state = {"kind": SFT_STATE_KIND, "step": history[-1]["optimizer_steps"], "history": history,
             "config": config.model_dump(mode="json"), "sft": settings.model_dump(mode="json")}
    (output_dir / "sft_metrics.jsonl").write_text("".join(json.dumps(h) + "\n" for h in history))
    return save_checkpoint(output_dir / "checkpoints", history[-1]["optimizer_steps"], policy.save, state,
                           keep_last=1)
