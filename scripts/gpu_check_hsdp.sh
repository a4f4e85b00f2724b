#!/usr/bin/env bash
# HSDP recovery with CUDA tensors: the tests of tests/integration/test_hsdp.py (failure-free equality with
# torchrun, a rank killed mid-forward and after its update, an outside SIGKILL at a random moment) with every
# rank's model on a GPU, four ranks over gloo sharing the GPUs there are (one is enough). Run on a GPU machine
# from the repository root, in the project's environment:
#
#     bash scripts/gpu_check_hsdp.sh
#
# What it does not check: NCCL's abort (one GPU per rank; runtime/comm/group.py aborts every NCCL communicator
# of a generation in parallel threads), FSDP's CUDA streams under an abort of a real NCCL collective.
set -euo pipefail
python - <<'PY'
import torch
assert torch.cuda.is_available(), "no CUDA device: this check needs a GPU machine"
print(f"torch {torch.__version__}, {torch.cuda.device_count()} GPU(s): {torch.cuda.get_device_name(0)}")
PY
SWIFTRUN_TEST_DEVICE=cuda exec python -m pytest -q -p no:cacheprovider tests/integration/test_hsdp.py "$@"
