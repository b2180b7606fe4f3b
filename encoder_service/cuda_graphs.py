"""CUDA graphs of the vision tower, one per image shape: GPU towers only.

Why: on a GPU one image's pass is bound by kernel launches, not by the GPU's work. On an H200 the
2B-shaped tower took 21-29 ms eagerly for a 448x448 image whose 1.48 TFLOP would take 2 ms at the
card's peak: each of its hundreds of small kernels is launched from Python. A CUDA graph replays
all of them with one launch: 7.1 ms an image there (bench/gpu/README.md, run 4).

What runs in a graph: the patch embedding, the blocks and the merger for one grid (t, h, w). The
rotary tables and the attention's segment boundaries depend on the grid alone, so they are made
once per grid before capture; the boundaries stay on the CPU, so splitting attention per frame
needs no device sync, which a capture would refuse. Each image replays its own graph alone: the
same kernels on the same shapes as the eager pass of that image alone, so the same bits, whatever
else is in the batch.

Policy: a grid is captured the second time it is seen (a capture costs about three passes, wasted
on a shape that never comes back); the most recently used `max_graphs` are kept. A capture that
fails turns graphs off for the process, with a warning, and encoding goes on eagerly.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch
from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel
from transformers.vision_utils import get_vision_attention_seqlens, get_vision_position_ids

logger = logging.getLogger(__name__)

Grid = tuple[int, int, int]
# Grids whose sightings are counted; the least recently seen are forgotten beyond this.
SEEN_GRIDS = 4096
# Attention implementations that split segments with cu_seqlens on the CPU (flash attention wants
# them on the device, and computes its max length from them: not graph-safe as written here).
GRAPH_SAFE_ATTENTION = ("sdpa", "eager")


@dataclass(frozen=True)
class GridTables:
    """What one grid's pass needs besides its pixels: cos/sin on the device, boundaries on the CPU."""

    position_embeddings: tuple[torch.Tensor, torch.Tensor]
    cu_seqlens: torch.Tensor


def grid_tables(tower: Qwen2VisionTransformerPretrainedModel, grid: Grid, device: torch.device) -> GridTables:
    """The rotary tables and attention boundaries the tower computes for `grid` in its forward."""
    grid_thw = torch.tensor([grid], dtype=torch.int64)
    position_ids = get_vision_position_ids(grid_thw, tower.spatial_merge_size)
    cu_seqlens, _ = get_vision_attention_seqlens(grid_thw, tower.config)
    anchor = torch.empty(0, device=device)  # the rotary module reads only its input's device
    cos, sin = tower.rotary_pos_emb(anchor, position_ids.to(device))
    return GridTables((cos, sin), cu_seqlens)


def forward_with_tables(
    tower: Qwen2VisionTransformerPretrainedModel, pixels: torch.Tensor, tables: GridTables
) -> torch.Tensor:
    """The tower's forward for one image or video (its merged rows), given its grid's tables: what
    a graph captures. Equal to `tower(pixels, grid_thw).pooler_output` (tests/test_cuda_graphs.py)."""
    hidden = tower.patch_embed(pixels)
    for block in tower.blocks:
        hidden = block(hidden, cu_seqlens=tables.cu_seqlens, position_embeddings=tables.position_embeddings)
    return tower.merger(hidden)


@dataclass(frozen=True)
class _Captured:
    graph: torch.cuda.CUDAGraph
    pixels: torch.Tensor  # the graph reads its input here
    merged: torch.Tensor  # and writes its output here
    tables: GridTables  # read by the graph on every replay: kept alive with it


class TowerGraphs:
    """Per-grid CUDA graphs of one tower on one GPU. Callers run under torch.inference_mode()."""

    def __init__(self, tower: Qwen2VisionTransformerPretrainedModel, device: torch.device, max_graphs: int) -> None:
        if device.type != "cuda" or max_graphs < 1:
            raise ValueError(f"CUDA graphs need a cuda device and max_graphs >= 1, got {device}, {max_graphs}")
        self.tower, self.device, self.max_graphs = tower, device, max_graphs
        self.enabled = tower.config._attn_implementation in GRAPH_SAFE_ATTENTION
        self._graphs: OrderedDict[Grid, _Captured] = OrderedDict()
        self._seen: OrderedDict[Grid, int] = OrderedDict()
        self._lock = threading.Lock()  # one replay at a time: the graphs' buffers are shared state
        if not self.enabled:
            logger.warning("CUDA graphs off: attention %r is not graph-safe here", tower.config._attn_implementation)

    @property
    def captured(self) -> int:
        return len(self._graphs)

    def encode(self, pixels: torch.Tensor, grid: Grid) -> torch.Tensor | None:
        """One item's merged rows, copied to the CPU, from its grid's graph; None where no graph
        serves this grid (not seen often enough yet, or graphs are off): encode it eagerly."""
        with self._lock:
            captured = self._graph_for(pixels, grid)
            if captured is None:
                return None
            captured.pixels.copy_(pixels)
            captured.graph.replay()
            return captured.merged.to("cpu")  # copied before the next replay overwrites it

    def _graph_for(self, pixels: torch.Tensor, grid: Grid) -> _Captured | None:
        if not self.enabled:
            return None
        captured = self._graphs.get(grid)
        if captured is not None:
            self._graphs.move_to_end(grid)
            return captured
        sightings = self._seen.pop(grid, 0) + 1
        self._seen[grid] = sightings
        if len(self._seen) > SEEN_GRIDS:
            self._seen.popitem(last=False)
        if sightings < 2:
            return None
        try:
            captured = self._capture(pixels, grid_tables(self.tower, grid, self.device))
        except Exception:  # any capture failure: never fail a request over an optimisation
            logger.warning("CUDA graph capture failed for grid %s; graphs off, encoding eagerly", grid, exc_info=True)
            self.enabled = False
            self._graphs.clear()
            return None
        self._graphs[grid] = captured
        if len(self._graphs) > self.max_graphs:
            self._graphs.popitem(last=False)  # its memory pool is freed with it
        return captured

    def _capture(self, pixels: torch.Tensor, tables: GridTables) -> _Captured:
        static_pixels = pixels.clone()
        # One pass on a side stream first, as torch's graph docs ask: lazy initialisation (cuBLAS
        # handles, workspaces) must happen outside the capture.
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            forward_with_tables(self.tower, static_pixels, tables)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            merged = forward_with_tables(self.tower, static_pixels, tables)
        return _Captured(graph, static_pixels, merged, tables)
