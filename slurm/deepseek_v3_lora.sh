#!/bin/bash
# DeepSeek-V3 (671B) LoRA: conf/exp/deepseek_v3_lora.yaml on 4 node(s) x 8 H100 (32 GPUs), the experiment's cluster.num_gpus.
#   sbatch slurm/deepseek_v3_lora.sh [Hydra overrides, applied last]
#   sbatch -p PARTITION -A ACCOUNT slurm/deepseek_v3_lora.sh model.hf_path=/models/... data.path=/data/train.jsonl
# A requeued job resumes its own run (outputs/deepseek_v3_lora/slurm-<job id>); settings: slurm/common.sh.
#SBATCH --job-name=ftcore-deepseek_v3_lora
#SBATCH --nodes=4
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --exclusive
#SBATCH --mem=0
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

ftcore_run deepseek_v3_lora auto "$@"
