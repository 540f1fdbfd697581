"""DISTILL-V2 scored locally, as the env scores it: the cell reader, the env's rendering and its arithmetic."""
from ppo_affine.distill.cells import PUBLIC_BUCKET, Cell, Message, Rollout, ToolCall, read_cells
from ppo_affine.distill.evaluation import (CellResult, DistillScore, score_cells, score_cells_through_server,
                                           score_with)
from ppo_affine.distill.render import MAX_SEQ_LEN, render_rollout

__all__ = ["PUBLIC_BUCKET", "MAX_SEQ_LEN", "Cell", "CellResult", "DistillScore", "Message", "Rollout", "ToolCall",
           "read_cells", "render_rollout", "score_cells", "score_cells_through_server", "score_with"]
