"""The warm start (`sft_warmstart.py`): expert episodes in the env's evaluate() conversation, then supervised
fine-tuning of the LoRA adapter on the expert's replies, written as a checkpoint PPO starts from. Its options are
one `WarmStartConfig` (config.py); `run.run_warm_start` runs them in this order:

1. Generate (expert_play.py): for every game, `--episodes` episodes against the env's opponent, both seats (seed
   parity), the model's moves chosen by the game's expert (experts.py: CFR+ for leduc_poker, MCTS for sequential
   games, prize matching or Monte Carlo search for goofspiel). Every core plays episodes; the conversations go
   to `sft_data.jsonl` in the shape `logging.log_samples_every` writes. `--explore P` makes a P share of the
   turns random legal moves, which stay in the conversation untrained: the expert's later replies show how to
   recover from a slip. `--openings N` adds N episodes per game cut after the expert's first reply: more of the
   decision that decides short games (a liars_dice opening bid) at the cost of one prompt each. `--trace N`
   adds N trace tasks whose reply the interpreter writes (trace_teacher.py): the program's real stdout.
2. Relabel (relabel.py): `--relabel FILE` adds DAgger data, games a model played (evaluate.py's episodes.jsonl)
   replayed with the expert answering at every turn, so SFT also sees the expert's move at the states the
   student's own play reaches.
3. Train (sft.py): each conversation becomes token sequences exactly as a rollout builds them (the chat
   template, the configured context strategy, continued sequences); the loss is the mean negative
   log-likelihood of the assistant tokens (EOS included), everything else masked. `--init-adapter CHECKPOINT`
   trains that adapter on (more epochs) instead of a fresh LoRA. Saved as `checkpoints/checkpoint-<optimizer
   steps>` (adapter + a zero value head).
4. DAgger rounds (dagger.py): `--dagger-rounds N` relabels N times after the SFT. The newest adapter plays
   `--dagger-episodes` games of each game greedily on seeds of their own (as evaluate.py plays), the expert
   relabels them, and SFT goes on from that adapter on them beside what this call's SFT trained on and
   `--dagger-data`'s conversations, which hold the turns the student already plays in place (`--dagger-aggregate
   all`: and every earlier round's relabelled games, DAgger's full aggregate); each round's games, records and
   checkpoint go to `dagger-<round>/`, its student's score and expert agreement to `dagger.jsonl`. The student
   plays through the program (evaluate.py at the root), which hands the rounds a `dagger.StudentPlay`.
"""
