"""liars_dice's opening bid, over every hand: what a model bids first, against the true-bids teacher.

Against the validators' MCTS, which sees every die, liars_dice is decided by the first seat's opening
bid: it wins only when it names the highest bid that holds (`experts.true_bid_choice`). There are 252
sorted hands of five dice, so that decision can be checked whole:

    python -m bench.liars_openings probe --adapter runs/x/sft/checkpoints/checkpoint-48
    python -m bench.liars_openings probe --seat second --deals 400 --adapter CHECKPOINT
    python -m bench.liars_openings compare BEFORE.jsonl AFTER.jsonl   (two probes' --replies files)
    python -m bench.liars_openings data --output runs/liars-openings/openings.jsonl [--reason [--id-steps] [--games N]]

`probe` renders the env's first-seat opening prompt for every hand (the env's own text, only the dice
line differs), lets the model answer greedily and prints one JSON document, every average weighted by
the hand's probability: how often it bids what the teacher bids, the chance its opening wins against
an opponent that answers with the highest bid that holds (the teacher's is the bound, 0.234), the
share of legal bids and the distinct bids it made. `--adapter base` probes the base model.
`probe --seat second` asks for the second seat's bid instead, on `--deals` deals (seeds of their own,
none an evaluation or SFT seed) after the validators' MCTS opened at its full budget: the second mover
wins against an opponent that sees every die exactly when its bid is the highest that holds (and it
calls Liar on the forced raise), so each reply is scored by that, beside the `count_bids` and
`true_bids` teachers' bids on the same deals, with a paired interval for model minus `count_bids`.
`data` writes the teacher's opening for every hand as SFT records (sft_warmstart.py --data), each
conversation cut after that reply; with `--reason` the reply counts first (`opening_reason`), and a
probe of such a model needs room for it (`--max-new-tokens 72`: the longest is 66 tokens; 112 with
`--id-steps`, whose longest is 106): the score reads the reply think-stripped, as the env does.
"""
from __future__ import annotations

import argparse
import collections
import itertools
import json
import re
import time
import uuid
from pathlib import Path

from ppo_affine.envs.openspiel_episode import Episode
from ppo_affine.envs.openspiel_text import strip_think
from ppo_affine.envs.tasks import game_task_id
from ppo_affine.experts import (LIAR, action_bid, bid_action, bid_label, counting_bid, counting_steps,
                                dice_compositions, highest_true_bid, true_bid_choice)
from ppo_affine.report import mean_interval
from ppo_affine.seeds import derive_seed

HANDS = list(itertools.combinations_with_replacement(range(1, 7), 5))  # the order dice_compositions uses
FIRST_SEAT_SEED = 0  # an even seed: the model moves first
SECOND_SEAT_STREAM = "liars-second-seat-probe"  # derive_seed's stream for `second_seat_deal`


def opening_conversations() -> list[list[dict[str, str]]]:
    """The env's system prompt and first-seat opening prompt for every hand in HANDS."""
    episode = Episode(uuid.uuid4().hex, task_id=game_task_id("liars_dice", 0), seed=FIRST_SEAT_SEED, opponent="random",
                      observation_format="evaluate", max_parse_attempts=3, mcts_simulations=None)
    prompt = episode.start()["observation"]
    dice_line = next(line for line in prompt.splitlines() if line.startswith("Your dice:"))
    conversations = []
    for hand in HANDS:
        shown = ", ".join(map(str, hand))
        conversations.append([{"role": "system", "content": episode.system_prompt},
                              {"role": "user", "content": prompt.replace(dice_line,
                                                                         f"Your dice: [{shown}] (showing: {shown})")}])
    return conversations


def second_seat_deal(index: int) -> dict:
    """Deal `index` with the model in the second seat: the env's conversation after the validators' MCTS
    (full budget, fast search) opened, the model's sorted dice, the opening, and the highest bid that holds."""
    seed = derive_seed(SECOND_SEAT_STREAM, index) | 1  # an odd seed: the model moves second
    episode = Episode(uuid.uuid4().hex, task_id=game_task_id("liars_dice", 0), seed=seed, opponent="mcts",
                      observation_format="evaluate", max_parse_attempts=3, mcts_simulations=None)
    prompt = episode.start()["observation"]
    state = episode.state
    hand, theirs = ([int(d) for d in state.information_state_string(p).split()[0]] for p in (1, 0))
    return {"seed": seed, "hand": sorted(hand), "opening": state.history()[-1], "legal": episode.legal,
            "highest": highest_true_bid(hand, theirs),
            "conversation": [{"role": "system", "content": episode.system_prompt}, {"role": "user", "content": prompt}]}


def second_seat_deals(count: int, workers: int) -> list[dict]:
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(workers) as pool:
        return list(pool.map(second_seat_deal, range(count)))


def score_second_seat(deals: list[dict], replies: list[str]) -> dict:
    """Second-seat replies scored by whether each bid is the highest that holds (`probe --seat second`),
    with the two teachers' bids on the same deals and the share that bid as `count_bids` does."""
    hits, counted_hits, true_hits, agree, legal = [], [], [], [], []
    for deal, reply in zip(deals, replies, strict=True):
        action = reply_action(reply)
        opening = action_bid(deal["opening"])
        counted = counting_bid(deal["hand"], opening)[0]
        hits.append(float(action == deal["highest"]))
        counted_hits.append(float(counted == deal["highest"]))
        true_hits.append(float(true_bid_choice(deal["hand"], [opening], deal["legal"])[0] == deal["highest"]))
        agree.append(float(action == counted))
        legal.append(float(action in deal["legal"]))

    def rate(values: list[float], low: float = 0.0) -> dict:
        mean, interval = mean_interval(values, low, 1.0)
        return {"mean": round(mean, 4), "ci95": [round(v, 4) for v in interval] if interval else None}

    return {"deals": len(deals), "bids_the_highest_that_holds": rate(hits), "count_bids": rate(counted_hits),
            "true_bids": rate(true_hits), "minus_count_bids": rate([a - b for a, b in zip(hits, counted_hits)], -1.0),
            "agrees_with_count_bids": round(sum(agree) / len(agree), 4), "legal": round(sum(legal) / len(legal), 4),
            "liar_calls": sum(1 for reply in replies if reply_action(reply) == LIAR)}


def teacher_openings() -> list[tuple[int, float]]:
    """The true-bids teacher's opening and its chance to win for every hand in HANDS."""
    return [true_bid_choice(list(hand), [], list(range(LIAR))) for hand in HANDS]


def opening_reason(hand: tuple[int, ...], action: int, id_steps: bool = False) -> str:
    """The teacher's opening worked out in steps a small model can copy from the sorted dice line
    (`experts.counting_steps`, then `experts.bid_label`), e.g. [1, 3, 3, 6, 6] -> '6s: 2; 1s: 1; 3s: 2;
    best 3s: 2+2=4; bid 6-3' (the ID 32 follows the think block); with `id_steps` the label leads on to
    the ID ('bid 6-3: 6-1 30, 6-2 31, 6-3 32'). The teacher bids the commonest face (the highest of a tie)
    at two more than it holds (`experts.counting_bid`)."""
    return "; ".join([*counting_steps(list(hand), action_bid(action)[1]), bid_label(action, id_steps)])


def write_data(path: Path, with_reason: bool = False, id_steps: bool = False, games: list[dict] = ()) -> None:
    """Every hand's opening as a record, then `games` (`game_records`)."""
    def reply(hand: tuple[int, ...], action: int) -> str:
        return f"<think>{opening_reason(hand, action, id_steps)}</think>{action}" if with_reason else str(action)

    records = [{"step": 0, "env": "openspiel", "task_id": game_task_id("liars_dice", 0), "seed": FIRST_SEAT_SEED,
                "game": "liars_dice", "score": None, "error": None, "max_replies": 1,
                "messages": [*conversation, {"role": "assistant", "content": reply(hand, action)}],
                "expert": "true_bids", "opponent": "mcts", "llm_player_id": 0, "explored_replies": []}
               for hand, conversation, (action, _) in zip(HANDS, opening_conversations(), teacher_openings())]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in [*records, *games]))
    print(f"{len(records)} openings" + (f" and {len(games)} games" if games else "") + f" -> {path}")


def game_records(games: int, workers: int, seed: int, id_steps: bool = False) -> list[dict]:
    """`games` whole expert games (the true-bids teacher against the validators' MCTS at its full budget,
    seats alternating, sft_warmstart's seeds: none is an evaluation seed), each first-seat game's opening
    rewritten as the reasoned reply (`opening_reason`); the later replies (a Liar call or a raise, and
    every second-seat reply) stay ID-only. The openings data alone never shows the turn after the
    opening, where a true opening wins only by calling Liar on the opponent's forced false raise."""
    from ppo_affine.warm_start.config import WarmStartConfig
    from ppo_affine.warm_start.expert_play import OpponentSetup, generate, plan_jobs

    settings = WarmStartConfig(games=["liars_dice"], episodes=games, opponent="mcts",
                               experts={"liars_dice": "true_bids"})
    records = generate(plan_jobs(settings, seed, OpponentSetup()), workers, None)
    for record in records:
        if record["llm_player_id"] != 0:
            continue
        opening = next(m for m in record["messages"] if m["role"] == "assistant")
        dice = re.search(r"Your dice: \[([1-6, ]+)\]", record["messages"][1]["content"])
        hand = tuple(sorted(int(d) for d in dice.group(1).split(",")))
        action = int(opening["content"])
        if action != true_bid_choice(list(hand), [], list(range(LIAR)))[0]:  # the teacher's opening depends on the dice alone
            raise AssertionError(f"seed {record['seed']}: the game opened {action}, the openings data has another bid")
        opening["content"] = f"<think>{opening_reason(hand, action, id_steps)}</think>{action}"
    return records


def reply_action(reply: str) -> int:
    """The action ID a reply names as the env reads it (reasoning stripped), or -1 when it names none."""
    reply = strip_think(reply)  # strip_think also trims whitespace
    return int(reply) if reply.isdigit() else -1


def opening_chance(hand: tuple[int, ...], reply: str) -> tuple[int, float]:
    """The bid a reply makes as the env reads it (reasoning stripped; -1 if no bid) and its chance to win."""
    action = reply_action(reply)
    if not 0 <= action < LIAR:
        return -1, 0.0
    return action, true_bid_choice(list(hand), [], [action])[1]  # offered only this bid, the teacher scores it


def compare_replies(before: Path, after: Path) -> dict:
    """Two probes' `--replies` files, hand by hand: the opening win chance of each (weighted by the
    hand's probability), their difference, and every hand whose bid changed. Both are greedy policies
    scored exactly over the opponent's dice, so the difference has no sampling error to put an interval on."""
    _, weights = dice_compositions(5, 6)
    rows = [[json.loads(line) for line in path.read_text().splitlines()] for path in (before, after)]
    if [tuple(r["hand"]) for r in rows[0]] != HANDS or [tuple(r["hand"]) for r in rows[1]] != HANDS:
        raise SystemExit(f"{before} and {after} must each hold one reply per hand, in HANDS order (probe --replies)")
    totals, changes = [0.0, 0.0], []
    for hand, weight, first, second in zip(HANDS, weights, *rows, strict=True):
        (bid_a, win_a), (bid_b, win_b) = opening_chance(hand, first["reply"]), opening_chance(hand, second["reply"])
        totals[0] += weight * win_a
        totals[1] += weight * win_b
        if bid_a != bid_b:
            changes.append({"hand": list(hand), "weight": round(float(weight), 5), "bids": [bid_a, bid_b],
                            "win_chance": [round(win_a, 4), round(win_b, 4)], "teacher": first["teacher"]})
    changes.sort(key=lambda change: -change["weight"])
    return {"win_chance": [round(totals[0], 4), round(totals[1], 4)], "difference": round(totals[1] - totals[0], 4),
            "hands_changed": len(changes), "mass_changed": round(float(sum(c["weight"] for c in changes)), 4),
            "changes": changes}


def score_openings(replies: list[str]) -> dict:
    """Replies to the HANDS' opening prompts, scored against the teacher's openings (module docstring);
    a reply counts as the env reads it, its reasoning stripped."""
    _, weights = dice_compositions(5, 6)
    agree = win = legal = 0.0
    teacher = teacher_openings()
    replies = [strip_think(reply) for reply in replies]  # strip_think also trims whitespace
    for hand, weight, reply, (expected, _) in zip(HANDS, weights, replies, teacher, strict=True):
        action, chance = opening_chance(hand, reply)
        legal += weight * (action >= 0)
        win += weight * chance
        agree += weight * (action == expected)
    bids = collections.Counter(replies)
    return {"hands": len(HANDS), "agrees_with_teacher": round(float(agree), 4), "opening_win_chance": round(float(win), 4),
            "teacher_opening_win_chance": round(float(sum(w * p for w, (_, p) in zip(weights, teacher))), 4),
            "legal": round(float(legal), 4), "distinct_replies": len(bids), "most_common": bids.most_common(5)}


def score_reasons(replies: list[str]) -> dict:
    """Where a reasoned student goes wrong (`opening_reason`'s steps), each share weighted by the hand's
    probability: the reason's dice counts (everything before 'best') as the teacher's, its bid label as
    the teacher's, and, over the replies whose reason names a bid, the ID that label's action."""
    _, weights = dice_compositions(5, 6)
    counts = label = follows = labelled = 0.0
    for hand, weight, reply, (expected, _) in zip(HANDS, weights, replies, teacher_openings(), strict=True):
        match = re.search(r"<think>(.*?)</think>\s*(\S*)", reply, re.DOTALL)
        if match is None:
            continue
        reason, action = match.group(1).strip(), match.group(2)
        counts += weight * (reason.partition("; best ")[0] == opening_reason(hand, expected).partition("; best ")[0])
        named = re.search(r"bid (\d+)-([1-6])(?::|$)", reason)  # with or without the ID steps after it
        if named:
            named_action = bid_action(int(named.group(1)), int(named.group(2)))
            label += weight * (named_action == expected)
            labelled += weight
            follows += weight * (action == str(named_action))
    return {"counts_like_teacher": round(float(counts), 4), "bid_label_like_teacher": round(float(label), 4),
            "id_follows_own_label": round(float(follows / labelled), 4) if labelled else None}


def greedy_replies(policy, builder, conversations: list[list[dict[str, str]]], batch: int,
                   max_new_tokens: int) -> list[str]:
    """The policy's greedy reply to each conversation, prompted with the ids a rollout would use
    (`builder`: a PromptBuilder) and cut at the first EOS."""
    import torch

    from ppo_affine.generation import cut_at_eos, eos_token_ids

    tokenizer = policy.tokenizer
    eos_ids = eos_token_ids(tokenizer, policy.model.generation_config)
    replies = []
    for first in range(0, len(conversations), batch):
        prompts = [builder.encode(c) for c in conversations[first:first + batch]]
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), tokenizer.pad_token_id)
        mask = torch.zeros_like(ids)
        for row, prompt in enumerate(prompts):  # left-padded, so every reply starts at `width`
            ids[row, width - len(prompt):] = torch.tensor(prompt)
            mask[row, width - len(prompt):] = 1
        with torch.no_grad():
            out = policy.model.generate(input_ids=ids.to(policy.device), attention_mask=mask.to(policy.device),
                                        max_new_tokens=max_new_tokens, do_sample=False,
                                        pad_token_id=tokenizer.pad_token_id, eos_token_id=sorted(eos_ids))
        replies += [tokenizer.decode(cut_at_eos(row, eos_ids), skip_special_tokens=True).strip()
                    for row in out[:, width:].tolist()]
    return replies


def probe(adapter: str, batch: int, max_new_tokens: int, overrides: list[str], replies_path: Path | None = None,
          seat: str = "first", deals: int = 400, workers: int = 2) -> dict:
    """Greedy openings of the cpu preset's model (with `overrides`) and `adapter` on every hand, scored
    (`score_reasons` too where the model reasons), or with `seat` "second" its bids after the MCTS's
    opening on `deals` deals (`score_second_seat`); `replies_path`: also each reply, as JSON lines."""
    from ppo_affine.model_files import pick_device
    from ppo_affine.policy import adapter_folder, load_policy
    from ppo_affine.prompts import PromptBuilder
    from ppo_affine.config import load_config

    config = load_config(presets=["cpu"], overrides=overrides).train
    adapter_dir = None if adapter == "base" else adapter_folder(Path(adapter))  # a wrong path fails before the load
    second = second_seat_deals(deals, workers) if seat == "second" else []
    policy = load_policy(config.model, config.lora, pick_device(config.run.device))
    if adapter_dir is not None:
        policy.load_adapter(adapter_dir)
    builder = PromptBuilder(policy.tokenizer, config.generation.max_prompt_tokens, config.model.chat_template_kwargs)
    started = time.perf_counter()
    conversations = [deal["conversation"] for deal in second] if second else opening_conversations()
    replies = greedy_replies(policy, builder, conversations, batch, max_new_tokens)
    seconds = round(time.perf_counter() - started, 1)
    if second:
        rows = [{"seed": deal["seed"], "hand": deal["hand"], "opening": deal["opening"], "highest": deal["highest"],
                 "reply": reply} for deal, reply in zip(second, replies)]
        result = score_second_seat(second, replies)
    else:
        rows = [{"hand": hand, "reply": reply, "teacher": action}
                for hand, reply, (action, _) in zip(HANDS, replies, teacher_openings())]
        reasoned = any("<think>" in reply for reply in replies)
        result = {**score_openings(replies), **(score_reasons(replies) if reasoned else {})}
    if replies_path is not None:
        replies_path.parent.mkdir(parents=True, exist_ok=True)
        replies_path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return {"adapter": adapter, "seat": seat, **result, "seconds": seconds}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    probing = commands.add_parser("probe", help="a model's greedy opening on every hand, against the teacher's")
    probing.add_argument("--adapter", required=True, help="a checkpoint or adapter folder, or 'base'")
    probing.add_argument("--batch", type=int, default=12, help="prompts per generate call")
    probing.add_argument("--max-new-tokens", type=int, default=6)
    probing.add_argument("--set", action="append", default=[], help="config overrides, e.g. run.device=cuda")
    probing.add_argument("--replies", type=Path, help="also write each hand's reply and the teacher's ID here (JSON lines)")
    probing.add_argument("--seat", choices=["first", "second"], default="first",
                         help="second: the bid after the validators' MCTS opened, on --deals deals")
    probing.add_argument("--deals", type=int, default=400, help="with --seat second: how many deals")
    probing.add_argument("--workers", type=int, default=2, help="with --seat second: processes dealing (MCTS openings)")
    comparing = commands.add_parser("compare", help="two probes' --replies files, hand by hand")
    comparing.add_argument("before", type=Path)
    comparing.add_argument("after", type=Path)
    data = commands.add_parser("data", help="the teacher's opening on every hand, as SFT records")
    data.add_argument("--output", type=Path, required=True)
    data.add_argument("--reason", action="store_true", help="replies '<think>the count</think>ID' (opening_reason)")
    data.add_argument("--id-steps", action="store_true",
                      help="with --reason: the reason goes on from the bid's label to its ID (opening_reason)")
    data.add_argument("--games", type=int, default=0,
                      help="also this many whole expert games against the validators' MCTS, first-seat openings "
                      "reasoned as the rest (game_records)")
    data.add_argument("--workers", type=int, default=2, help="processes playing --games")
    data.add_argument("--seed", type=int, default=0, help="--games' seeds derive from it")
    args = parser.parse_args(argv)
    if args.command == "data":
        if args.id_steps and not args.reason:
            parser.error("--id-steps adds to the reason: it needs --reason")
        if args.games < 0 or (args.games and not args.reason):
            parser.error("--games takes a count >= 0 and needs --reason (its openings are rewritten as reasons)")
        games = game_records(args.games, args.workers, args.seed, args.id_steps) if args.games else []
        write_data(args.output, args.reason, args.id_steps, games)
    elif args.command == "compare":
        print(json.dumps(compare_replies(args.before, args.after), indent=1))
    else:
        if args.deals < 1:
            parser.error("--deals takes a count >= 1")
        print(json.dumps(probe(args.adapter, args.batch, args.max_new_tokens, args.set, args.replies, args.seat,
                               args.deals, args.workers), indent=1))


if __name__ == "__main__":
    main()
