"""bench/liars_openings.py: liars_dice's opening bid on every hand, scored against the true-bids teacher."""
import importlib.util
import json
from pathlib import Path

import pytest

from bench.teacher_score import highest_true_bid_guess_rate
from ppo_affine.experts import dice_compositions, true_bid_choice

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("bench_liars_openings", ROOT / "bench" / "liars_openings.py")
liars_openings = importlib.util.module_from_spec(spec)
spec.loader.exec_module(liars_openings)


def test_the_opening_probe_scores_the_teachers_own_bids_at_the_bound(tmp_path):
    teacher = [str(action) for action, _ in liars_openings.teacher_openings()]
    scored = liars_openings.score_openings(teacher)
    assert scored["agrees_with_teacher"] == 1.0 and scored["legal"] == 1.0
    assert scored["opening_win_chance"] == scored["teacher_opening_win_chance"] == round(highest_true_bid_guess_rate(5), 4)
    # one bid for every hand (what the SFT student did): right only where the teacher bids it too
    always = liars_openings.score_openings(["25"] * len(teacher))
    assert always["distinct_replies"] == 1 and 0 < always["agrees_with_teacher"] < 0.2
    assert always["opening_win_chance"] < scored["opening_win_chance"]
    assert liars_openings.score_openings(["Liar"] * len(teacher))["legal"] == 0.0
    with pytest.raises(ValueError):  # one reply per hand
        liars_openings.score_openings(teacher[:-1])
    liars_openings.write_data(tmp_path / "openings.jsonl")
    records = [json.loads(line) for line in (tmp_path / "openings.jsonl").read_text().splitlines()]
    assert [r["messages"][-1]["content"] for r in records] == teacher
    assert all(f"Your dice: [{', '.join(map(str, hand))}]" in r["messages"][1]["content"]
               for r, hand in zip(records, liars_openings.HANDS))
    # only the dice line differs
    assert len({r["messages"][1]["content"].replace(r["messages"][1]["content"].splitlines()[1], "") for r in records}) == 1


def test_reasoned_openings_count_the_dice_before_the_teachers_bid(tmp_path):
    reason = liars_openings.opening_reason
    assert reason((1, 3, 3, 6, 6), 32) == "6s: 2; 1s: 1; 3s: 2; best 3s: 2+2=4; bid 6-3"
    assert reason((1, 2, 3, 4, 5), 16) == "6s: 0; 1s: 1; 2s: 1; 3s: 1; 4s: 1; 5s: 1; best 5s: 1+0=1; bid 3-5"
    assert reason((6, 6, 6, 6, 6), 41) == "6s: 5; best 6s: 5; bid 7-6"
    liars_openings.write_data(tmp_path / "reasoned.jsonl", with_reason=True)
    records = [json.loads(line) for line in (tmp_path / "reasoned.jsonl").read_text().splitlines()]
    replies = [r["messages"][-1]["content"] for r in records]
    teacher = liars_openings.teacher_openings()
    assert replies[100] == "<think>6s: 2; 1s: 1; 3s: 2; best 3s: 2+2=4; bid 6-3</think>32"
    # every reason ends on the label of the ID it precedes, and the env reads the ID alone
    assert all(r.startswith("<think>") and r.endswith(f"</think>{action}") and f"bid {action // 6 + 1}-{action % 6 + 1}<" in r
               for r, (action, _) in zip(replies, teacher))
    assert liars_openings.score_openings(replies)["agrees_with_teacher"] == 1.0
    assert liars_openings.score_openings(["<think>6s: 2</think>"] * len(replies))["legal"] == 0.0


def test_id_steps_count_from_the_bids_first_face_up_to_its_id(tmp_path):
    reason = liars_openings.opening_reason
    assert reason((1, 3, 3, 6, 6), 32, id_steps=True) == "6s: 2; 1s: 1; 3s: 2; best 3s: 2+2=4; bid 6-3: 6-1 30, 6-2 31, 6-3 32"
    assert reason((6, 6, 6, 6, 6), 41, id_steps=True).endswith("bid 7-6: 7-1 36, 7-2 37, 7-3 38, 7-4 39, 7-5 40, 7-6 41")
    liars_openings.write_data(tmp_path / "ids.jsonl", with_reason=True, id_steps=True)
    replies = [json.loads(line)["messages"][-1]["content"] for line in (tmp_path / "ids.jsonl").read_text().splitlines()]
    teacher = liars_openings.teacher_openings()
    # the last step names the ID the reply gives, and the steps before it are the label's quantity from face 1
    for reply, (action, _) in zip(replies, teacher, strict=True):
        steps = reply.removesuffix(f"</think>{action}").rpartition(": ")[2].split(", ")
        assert steps == [f"{action // 6 + 1}-{f} {action - action % 6 + f - 1}" for f in range(1, action % 6 + 2)]
    assert liars_openings.score_reasons(replies) == {"counts_like_teacher": 1.0, "bid_label_like_teacher": 1.0,
                                                     "id_follows_own_label": 1.0}
    # a student that counts up but writes another ID: the label still scores, the ID does not follow it
    strays = liars_openings.score_reasons([reply.rpartition("</think>")[0] + "</think>59" for reply in replies])
    assert strays["bid_label_like_teacher"] == 1.0 and strays["id_follows_own_label"] == 0.0
    with pytest.raises(SystemExit):  # the ID steps extend a reason
        liars_openings.main(["data", "--output", str(tmp_path / "x.jsonl"), "--id-steps"])


def test_whole_games_keep_the_teachers_moves_with_the_opening_reasoned(tmp_path):
    from ppo_affine.envs.openspiel_text import strip_think

    games = liars_openings.game_records(4, 1, 0, id_steps=True)  # the validators' MCTS, seats alternating
    assert [r["llm_player_id"] for r in games] == [0, 1, 0, 1] and all(r["score"] is not None for r in games)
    for record in games:
        replies = [m["content"] for m in record["messages"] if m["role"] == "assistant"]
        if record["llm_player_id"] == 0:  # the opening reasons up to the teacher's ID, the later replies do not
            dice = record["messages"][1]["content"].split("Your dice: [")[1].split("]")[0]
            hand = tuple(sorted(int(d) for d in dice.split(", ")))
            action = liars_openings.true_bid_choice(list(hand), [], list(range(liars_openings.LIAR)))[0]
            assert replies[0] == f"<think>{liars_openings.opening_reason(hand, action, True)}</think>{action}"
            assert strip_think(replies[0]) == str(action)
            replies = replies[1:]
        assert all(reply.isdigit() for reply in replies)
    liars_openings.write_data(tmp_path / "both.jsonl", with_reason=True, id_steps=True, games=games)
    written = [json.loads(line) for line in (tmp_path / "both.jsonl").read_text().splitlines()]
    assert len(written) == 252 + 4 and written[252:] == games
    for wrong in (["--games", "2"], ["--reason", "--games", "-1"]):  # the games' openings are reasons
        with pytest.raises(SystemExit):
            liars_openings.main(["data", "--output", str(tmp_path / "x.jsonl"), *wrong])


def test_the_probe_asks_the_model_each_hands_opening_prompt(tiny_policy):
    from ppo_affine.prompts import PromptBuilder

    conversations = liars_openings.opening_conversations()
    assert len(conversations) == 252 and conversations[0][1]["content"].startswith("Current State:\nYour dice: [1, 1")
    replies = liars_openings.greedy_replies(tiny_policy, PromptBuilder(tiny_policy.tokenizer, 8192), conversations[:3], 2, 3)
    assert len(replies) == 3 and all(isinstance(r, str) for r in replies)


def test_the_reason_score_says_which_step_a_reasoned_student_gets_wrong():
    teacher = liars_openings.teacher_openings()
    reasons = [liars_openings.opening_reason(hand, action) for hand, (action, _) in zip(liars_openings.HANDS, teacher)]
    right = [f"<think>{reason}</think>{action}" for reason, (action, _) in zip(reasons, teacher)]
    assert liars_openings.score_reasons(right) == {"counts_like_teacher": 1.0, "bid_label_like_teacher": 1.0,
                                                   "id_follows_own_label": 1.0}
    # the teacher's reasons with one ID for every hand: the counts and labels hold, the ID follows
    # its own label only where the teacher bids that ID (the probability of those hands)
    _, weights = liars_openings.dice_compositions(5, 6)
    share_28 = round(float(sum(w for w, (action, _) in zip(weights, teacher) if action == 28)), 4)
    always_28 = liars_openings.score_reasons([f"<think>{reason}</think>28" for reason in reasons])
    assert always_28["counts_like_teacher"] == always_28["bid_label_like_teacher"] == 1.0
    assert 0 < always_28["id_follows_own_label"] == share_28 < 1
    # what the 1-epoch student wrote for five 1s: the faces but not their count, a wrong label, an ID
    # that is not its label's (5-1 is 24)
    first = "<think>6s: 0; 1s: 1; best 1s: 1+0=1; bid 5-1</think>34"
    assert liars_openings.HANDS[0] == (1, 1, 1, 1, 1) and reasons[0] == "6s: 0; 1s: 5; best 1s: 5+0=5; bid 7-1"
    scored = liars_openings.score_reasons([first] + right[1:])
    assert scored["counts_like_teacher"] == scored["bid_label_like_teacher"] == round(1 - float(weights[0]), 4)
    assert scored["id_follows_own_label"] == round(1 - float(weights[0]), 4)
    # an ID alone has no reason to score: nothing counts
    assert liars_openings.score_reasons([str(action) for action, _ in teacher]) == {
        "counts_like_teacher": 0.0, "bid_label_like_teacher": 0.0, "id_follows_own_label": None}


def test_compare_reads_two_probes_hand_by_hand(tmp_path):
    teacher = liars_openings.teacher_openings()
    hand_index = liars_openings.HANDS.index((2, 2, 2, 4, 6))  # the teacher bids 31 (6-2) there
    _, weights = dice_compositions(5, 6)
    changed = ["<think>counting</think>25" if i == hand_index else str(a) for i, (a, _) in enumerate(teacher)]
    files = []
    for name, replies in (("before", [str(a) for a, _ in teacher]), ("after", changed)):
        files.append(tmp_path / f"{name}.jsonl")
        files[-1].write_text("".join(json.dumps({"hand": hand, "reply": reply, "teacher": action}) + "\n"
                                     for hand, reply, (action, _) in zip(liars_openings.HANDS, replies, teacher)))
    result = liars_openings.compare_replies(*files)
    lost = true_bid_choice([2, 2, 2, 4, 6], [], [31])[1] - true_bid_choice([2, 2, 2, 4, 6], [], [25])[1]
    assert result["win_chance"][0] == round(highest_true_bid_guess_rate(5), 4)
    assert result["difference"] == pytest.approx(-weights[hand_index] * lost, abs=1e-4) and lost > 0
    assert result["hands_changed"] == 1 and result["changes"][0]["bids"] == [31, 25]
    assert result["changes"][0]["teacher"] == 31
    files[1].write_text(files[1].read_text().splitlines()[0] + "\n")
    with pytest.raises(SystemExit, match="one reply per hand"):
        liars_openings.compare_replies(*files)


def test_the_second_seat_probe_scores_bids_by_whether_they_are_the_highest_that_holds():
    deals = [liars_openings.second_seat_deal(i) for i in range(3)]
    again = liars_openings.second_seat_deal(1)
    assert {k: v for k, v in again.items() if k != "conversation"} == {k: v for k, v in deals[1].items()
                                                                       if k != "conversation"}
    assert again["conversation"] == deals[1]["conversation"]  # the same MCTS opening from the same seed
    for deal in deals:
        prompt = deal["conversation"][1]["content"]
        quantity, face = deal["opening"] // 6 + 1, deal["opening"] % 6 + 1
        assert deal["seed"] % 2 == 1 and f'Current bid: "{quantity}-{face}"' in prompt
        assert f"Your dice: [{', '.join(map(str, deal['hand']))}]" in prompt
        assert deal["legal"] == list(range(deal["opening"] + 1, 61)) and deal["highest"] >= deal["opening"]
    counted = [liars_openings.counting_bid(d["hand"], (d["opening"] // 6 + 1, d["opening"] % 6 + 1))[0] for d in deals]
    teacher = liars_openings.score_second_seat(deals, [f"<think>steps</think>{a}" for a in counted])
    assert teacher["agrees_with_count_bids"] == teacher["legal"] == 1.0
    assert teacher["bids_the_highest_that_holds"] == teacher["count_bids"]
    assert teacher["minus_count_bids"]["mean"] == 0.0
    # hand-made deals: the highest bid that holds is 34; a reply naming it scores, Liar and nonsense do not
    made = [{**deals[0], "opening": 20, "legal": list(range(21, 61)), "highest": 34} for _ in range(4)]
    scored = liars_openings.score_second_seat(made, ["34", "<think>x</think> 34", "60", "bid 5-5"])
    assert scored["bids_the_highest_that_holds"]["mean"] == 0.5
    assert scored["legal"] == 0.75 and scored["liar_calls"] == 1
    with pytest.raises(ValueError):  # one reply per deal
        liars_openings.score_second_seat(made, ["34"])


def test_the_probe_refuses_no_deals():
    with pytest.raises(SystemExit):
        liars_openings.main(["probe", "--adapter", "base", "--seat", "second", "--deals", "0"])
