#!/usr/bin/env bash
# Multi-node megagrpo training with torchrun. Run the same line on every node, changing only
# NODE_RANK; every rank runs the trainer and its part of a colocated vLLM engine (engines of
# rollout.tensor_parallel_size consecutive ranks, so keep them inside a node: k <= GPUS_PER_NODE).
# With rollout.placement=separate the last rollout.rollout_ranks ranks sample: put them on nodes
# of their own (ranks go node by node; GPUS_PER_NODE may differ between nodes), e.g. a training
# node of 8 and a rollout node of 8 with rollout.rollout_ranks=8.
# tests/test_multinode.py runs this script as two "nodes" over loopback (colocated, and separate
# placement with a training node of 2 ranks and a rollout node of 1), tests/test_elastic.py
# loses one of them mid-run (MIN_NODES=1 MAX_RESTARTS=1): the other resumes alone at DP=1.
#
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=node0 bash examples/launch_multinode.sh \
#       examples/llama3-8b-math.yaml run.steps=200        # on node0
#   NNODES=2 NODE_RANK=1 MASTER_ADDR=node0 bash examples/launch_multinode.sh \
#       examples/llama3-8b-math.yaml run.steps=200        # on node1
#
# Arguments: RECIPE.yaml, then key.sub=value overrides (the same on every node).
# Environment:
#   NNODES         number of nodes (default 2)
#   NODE_RANK      this node's index, 0 .. NNODES-1 (required)
#   MASTER_ADDR    host name or IP of node 0, reachable from every node (required)
#   MASTER_PORT    free TCP port on node 0 for the c10d rendezvous (default 29500)
#   RDZV_ID        job id shared by the nodes of one run, unique to it (e.g. the scheduler's job
#                  id; default megagrpo): a restart before the first checkpoint starts over only
#                  a run this id started in run.out_dir
#   MAX_RESTARTS   torchrun restarts every rank up to this many times after a rank or a node
#                  fails (default 0); each restart resumes from the newest intact checkpoint
#   MIN_NODES      fewest nodes to go on with (default NNODES): with fewer than NNODES, a node
#                  lost, the restart runs on the nodes left, at a smaller DP (the checkpoint
#                  reshards), once torchrun's rendezvous has waited ~30 s for the lost node
#   GPUS_PER_NODE  ranks per node, one per GPU (default 8)
#   PYTHON         interpreter with megagrpo installed (default .venv/bin/python if present)
#   OMP_NUM_THREADS           CPU threads per rank (default 8)
#   NCCL_SOCKET_IFNAME        optional: network interface NCCL's bootstrap uses (e.g. eth0)
#   NCCL_IB_HCA               optional: InfiniBand adapters NCCL may use (e.g. mlx5)
#   NCCL_DEBUG                optional: WARN or INFO to diagnose hangs at start-up
# World size = NNODES x GPUS_PER_NODE; it must be a multiple of parallel.tp x parallel.pp and
# divide data.batch_size by the DP size; the recipe is validated before anything starts. Check
# memory first with: python -m megagrpo plan --config RECIPE --gpus $((NNODES * GPUS_PER_NODE))
set -euo pipefail

RECIPE=${1:?usage: NODE_RANK=.. MASTER_ADDR=.. $0 RECIPE.yaml [key.sub=value ...]}
shift
NNODES=${NNODES:-2}
NODE_RANK=${NODE_RANK:?set NODE_RANK (0 .. NNODES-1)}
MASTER_ADDR=${MASTER_ADDR:?set MASTER_ADDR (host of node 0)}
MASTER_PORT=${MASTER_PORT:-29500}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}
if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python; fi
fi

# c10d rendezvous: node 0 hosts the store; ranks are handed out node by node, so the
# GPUS_PER_NODE ranks of a node are consecutive (training TP and vLLM engines stay inside it)
NODES=$NNODES
if [[ "${MIN_NODES:-$NNODES}" != "$NNODES" ]]; then NODES="$MIN_NODES:$NNODES"; fi
exec "$PYTHON" -m torch.distributed.run \
  --nnodes "$NODES" --node-rank "$NODE_RANK" --nproc-per-node "$GPUS_PER_NODE" \
  --max-restarts "${MAX_RESTARTS:-0}" \
  --rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT" \
  --rdzv-id "${RDZV_ID:-megagrpo}" \
  -m megagrpo train --config "$RECIPE" "$@"
