"""A file of the MCTS opponent's moves, so that models evaluated on the same seeds search only where
their games differ.

The opponent is seeded per game (openspiel_episode.build_bots): its move at a state is fixed by the
game, the seed, the seat, its budget and implementation, and the history that led there, since its
random streams have been drawn by the searches of every earlier opponent move of that history. So a
move found here for the same key is the move a search would make. The key holds what produced the move:
open_spiel's version and the search's identity (openspiel_episode.search_identity: implementation,
settings and a digest of the code that builds and runs it), so a file written by another search, budget
or version is never replayed; a recorded move that is not legal where it is replayed (a damaged or
foreign file) is searched again, with one warning. A replayed move does not draw from
the streams, though; the episode keeps the states it skipped and, at its first move not found here,
runs those searches first (their moves discarded), so the search that follows starts from the draws
it would have had. Games that repeat another model's to the end cost no search at all.

SQLite holds the moves: worker processes of one run, and the runs of one bench, share the file.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import sqlite3
import threading
from collections.abc import Collection
from typing import Any

import pyspiel

log = logging.getLogger(__name__)
_connections: dict[tuple[int, str], sqlite3.Connection] = {}
_lock = threading.Lock()  # in-process episodes search on threads; they share the process's connection
_warned_illegal: set[str] = set()  # files whose illegal recorded move this process has warned about


def move_key(*, game: str, params: dict[str, Any], seed: int, observation_format: str, seat: int,
             budget: tuple[int, int], search: str, history: list[int]) -> str:
    """Everything that fixes the seeded opponent's move at this point of one game; `search` is the search's
    identity (openspiel_episode.search_identity), the open_spiel version is added here."""
    fields = [pyspiel.__version__, game, sorted(params.items()),
              seed, observation_format, seat, list(budget), search, history]
    return hashlib.sha256(json.dumps(fields, default=str).encode()).hexdigest()


class OpponentMoves:
    """get/put of recorded moves in the SQLite file at `path` (created with its folder if missing)."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.path.abspath(os.path.expanduser(os.fspath(path)))

    def check(self) -> None:
        """Raise the ValueError a later get/put would, without creating the file: an existing file must be
        SQLite, a new one must be creatable (its nearest existing folder writable)."""
        if os.path.exists(self.path):
            self.get("")
            return
        folder = os.path.dirname(self.path)
        while not os.path.isdir(folder):
            if os.path.exists(folder):
                raise ValueError(f"opponent_moves: cannot create {self.path}: {folder} is not a folder")
            folder = os.path.dirname(folder)
        if not os.access(folder, os.W_OK | os.X_OK):
            raise ValueError(f"opponent_moves: cannot create {self.path}: {folder} is not writable")

    def _connection(self) -> sqlite3.Connection:
        # one connection per process, opened in it: a connection inherited through a fork is never used
        key = (os.getpid(), self.path)
        if key not in _connections:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            try:
                connection = sqlite3.connect(self.path, timeout=60, isolation_level=None, check_same_thread=False)
                connection.execute("PRAGMA journal_mode=WAL")
                connection.execute("CREATE TABLE IF NOT EXISTS moves (key TEXT PRIMARY KEY, action INTEGER NOT NULL)")
            except sqlite3.DatabaseError as error:
                raise ValueError(f"opponent_moves: {self.path} is not a usable SQLite file of opponent moves "
                                 f"({error}); give a new path or delete it") from error
            _connections[key] = connection
        return _connections[key]

    def get(self, key: str, legal: Collection[int] | None = None) -> int | None:
        """The recorded move, or None: none recorded, or one that is not in `legal` (warned once per file)."""
        with _lock:
            row = self._connection().execute("SELECT action FROM moves WHERE key = ?", (key,)).fetchone()
        if row is None:
            return None
        action = int(row[0])
        if legal is not None and action not in legal:
            if self.path not in _warned_illegal:
                _warned_illegal.add(self.path)
                log.warning("opponent_moves: %s recorded move %d where it is not legal (a damaged file, or one "
                            "written by other code); the opponent searches there instead", self.path, action)
            return None
        return action

    def put(self, key: str, action: int) -> None:
        # REPLACE: a searched move overwrites an illegal one recorded under its key
        with _lock:
            self._connection().execute("INSERT OR REPLACE INTO moves (key, action) VALUES (?, ?)", (key, int(action)))

    def __len__(self) -> int:
        with _lock:
            return self._connection().execute("SELECT COUNT(*) FROM moves").fetchone()[0]
