#!/bin/bash
# Llama 3.1 70B LoRA at 128k tokens: conf/exp/70b_lora_128k.yaml on 4 B200 of one node (tp=2, cp=2),
# the experiment's cluster.num_gpus: the fewest B200 the planner fits it on with context parallelism.
#   sbatch slurm/70b_lora_128k.sh [Hydra overrides, applied last]
#   sbatch -p PARTITION -A ACCOUNT slurm/70b_lora_128k.sh model.hf_path=/models/... data.path=/data/train.jsonl
# Half a node (the experiment sets cluster.gpus_per_node=4), not --exclusive: the node's other GPUs
# stay free for another job, so host memory is asked per GPU. A requeued job resumes its own run (outputs/70b_lora_128k/slurm-<job id>);
# settings: slurm/common.sh.
#SBATCH --job-name=ftcore-70b_lora_128k
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=4
#SBATCH --mem-per-gpu=200G
#SBATCH --time=24:00:00
#SBATCH --signal=B:USR1@600
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

ftcore_run 70b_lora_128k auto "$@"
