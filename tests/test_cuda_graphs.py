"""What a CUDA graph of the tower captures (encoder_service/cuda_graphs.py), checked on the CPU: the
graph machinery itself needs a GPU (bench/gpu runs it there and checks its bits), but the forward
it captures, with its per-grid tables made ahead, must be the tower's own forward, bit for bit."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from encoder_service.cuda_graphs import TowerGraphs, forward_with_tables, grid_tables
from encoder_service.vision import VisionEncoder

# An image (one frame) and a two-frame video: attention is split per frame.
GRIDS = [(1, 8, 12), (2, 4, 6)]


@pytest.fixture(scope="module")
def encoder(checkpoints: dict[str, Path]) -> VisionEncoder:
    return VisionEncoder.load(str(checkpoints["base"]), "cpu", torch.float32, "exact", cuda_graphs=8)


@pytest.mark.parametrize("grid", GRIDS, ids=lambda g: "x".join(map(str, g)))
def test_forward_with_tables_is_the_towers_forward_bit_for_bit(
    encoder: VisionEncoder, grid: tuple[int, int, int]
) -> None:
    tower = encoder.tower
    t, h, w = grid
    torch.manual_seed(sum(grid))
    pixels = torch.randn(t * h * w, 3 * 2 * 14 * 14)
    with torch.inference_mode():
        expected = tower(pixels, grid_thw=torch.tensor([grid])).pooler_output
        got = forward_with_tables(tower, pixels, grid_tables(tower, grid, torch.device("cpu")))
    assert got.shape == (t * h * w // 4, tower.config.hidden_size)
    assert torch.equal(got, expected)


def test_graphs_are_for_gpu_towers_only(encoder: VisionEncoder) -> None:
    assert encoder.graphs is None  # cuda_graphs=8 is ignored on a CPU
    with pytest.raises(ValueError, match="cuda device"):
        TowerGraphs(encoder.tower, torch.device("cpu"), 8)
