"""Measurements for a GPU host: `bash bench/gpu/run.sh` there (see bench/gpu/README.md).

Three parts, each written to the results as soon as it ends:
- encoder throughput (tower_loop.py, service_load.py): the 2B-shaped vision tower in bf16 at
  448x448, transformers' `get_image_features` in a plain loop against the encoder service (its
  batcher, over gRPC) at several concurrencies, with FLOP utilisation (flops.py);
- the golden check on the device (golden.py): the transformers engine's greedy tokens against
  transformers' own `generate` from pixels;
- the blob round trip (roundtrip.py): embeddings on the device -> blob -> Redis -> blob -> device,
  bit for bit, timed by stage.
"""
