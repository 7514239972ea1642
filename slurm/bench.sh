#!/bin/bash
# Benchmarks (python -m ftcore.bench +bench=NAME) on one GPU node: ftcore.bench runs each of the
# bench's configurations itself, starting their workers on this node, and appends the results to
# outputs/bench/<name>/ (bench.jsonl, bench.md, bench.png).
#   FTCORE_BENCH=h100_70b_lora sbatch slurm/bench.sh [Hydra overrides]
# No --requeue: a benchmark interrupted half-way is redone whole, not resumed.
#SBATCH --job-name=ftcore-bench
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --exclusive
#SBATCH --mem=0
#SBATCH --time=04:00:00
#SBATCH --open-mode=append
#SBATCH --output=slurm-%x-%j.out

# sbatch runs a copy of this file: ask SLURM where the original (and common.sh beside it) lives.
if [[ -z ${FTCORE_SLURM_DIR:-} ]]; then
	[[ -n ${SLURM_JOB_ID:-} ]] && command -v scontrol >/dev/null && here=$(scontrol show job "$SLURM_JOB_ID" 2>/dev/null | sed -n 's/^ *Command=\([^ ]*\).*/\1/p')
	FTCORE_SLURM_DIR=$(dirname "${here:-${BASH_SOURCE[0]}}")
	[[ -f $FTCORE_SLURM_DIR/common.sh ]] || FTCORE_SLURM_DIR=${SLURM_SUBMIT_DIR:-.}/slurm
fi
# shellcheck source=slurm/common.sh
source "$FTCORE_SLURM_DIR/common.sh" || exit 1

ftcore_once ftcore.bench "+bench=${FTCORE_BENCH:-h100_70b_lora}" "$@"
