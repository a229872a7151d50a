"""One process of a multi-host run: ``init_distributed`` from the environment, the global mesh, the sharded forward.

The test starts two of these on localhost, each with 4 fake CPU devices
(``XLA_FLAGS=--xla_force_host_platform_device_count=4``) and ``DEEPINFER_COORDINATOR``,
``DEEPINFER_NUM_PROCESSES``, ``DEEPINFER_PROCESS_ID`` set:
``python tests/sharded/shard_multihost.py PRESET OUT_PREFIX``. Each prints one JSON line (its
process index, the device counts, a checksum of the gathered logits) and writes the gathered logits
to ``OUT_PREFIX<process>.npy``.
"""

from __future__ import annotations

import json
import sys

from deepinfer_jax import sharding as sh

assert sh.init_distributed(timeout_s=60), "DEEPINFER_* multi-host settings are missing"

import jax
import numpy as np
from shard_common import model_and_inputs


def main(preset_name: str, out_prefix: str) -> None:
    cfg, params, ids = model_and_inputs()
    mesh = sh.make_mesh(preset_name)  # every process's devices
    logits = sh.sharded_forward_full(params, cfg, ids, mesh, preset_name)
    host = sh.gather_to_host(logits)
    np.save(f"{out_prefix}{jax.process_index()}.npy", host)
    print(json.dumps({
        "process": jax.process_index(), "processes": jax.process_count(), "devices": jax.device_count(),
        "local_devices": jax.local_device_count(), "addressable_rows": sorted(
            {s.index[0].start or 0 for s in logits.addressable_shards}),
        "checksum": float(np.abs(host).sum()),
    }), flush=True)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
