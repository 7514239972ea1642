#!/bin/bash
# The tiny experiment on CPU nodes (what the SLURM tests run): two workers in all, on one node
# (sbatch slurm/tiny_cpu.sh) or one on each of two nodes (sbatch --nodes=2 slurm/tiny_cpu.sh),
# meeting over gloo. It names no partition, account or memory and runs the project's venv (or the
# python on PATH when there is none), so it runs on any cluster's defaults. Extra arguments are Hydra overrides, applied last:
#   sbatch slurm/tiny_cpu.sh train.max_steps=20        FTCORE_EXP=tiny_lora sbatch slurm/tiny_cpu.sh
#SBATCH --job-name=ftcore-tiny
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --cpus-per-task=2
#SBATCH --time=00:30:00
#SBATCH --signal=B:USR1@60
#SBATCH --requeue
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

workers=${FTCORE_WORKERS:-2}
nnodes=${SLURM_JOB_NUM_NODES:-1}
if ((workers % nnodes)); then
	echo "ftcore: $workers workers do not split over $nnodes nodes; set FTCORE_WORKERS" >&2
	exit 2
fi
ftcore_run "${FTCORE_EXP:-tiny_full}" $((workers / nnodes)) "$@"
