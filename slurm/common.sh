# shellcheck shell=bash
# The batch-step logic every slurm/*.sh shares (sourced, not run on its own).
#
# One job = one `srun` step with one ftcore launcher per node (python -m ftcore.launch.node), which
# starts the workers of its node. Around that step this file:
# - derives run.dir from the job id (outputs/<exp>/slurm-<job id>), so a requeued job resumes its
#   own run (checkpoint.resume=auto), and keeps the job's log there too (logs/job.log);
# - turns SIGUSR1 (`#SBATCH --signal=B:USR1@N` before the time limit, or
#   `scancel --signal=USR1 --batch JOB`) into a stop request: it touches run.stop_file, which all
#   ranks check at each step boundary; the trainer saves a checkpoint and exits 3. Signals to the
#   batch shell do not reach the workers, and torchrun would kill them 30 s after a signal;
# - requeues the job (scontrol requeue, same job id) only when the step exited 3, at most
#   FTCORE_MAX_REQUEUES times; never after 0 (done), 2 (user error) or a crash. A SIGTERM (scancel,
#   the time limit, preemption) also asks the trainer to stop, but does not requeue: SLURM decides.
#
# Settings (environment; sbatch passes yours through):
#   FTCORE_OUTPUT_DIR     where runs go (default: <submit dir>/outputs); must be on a shared filesystem
#   FTCORE_RUN_DIR        the run directory itself (default: $FTCORE_OUTPUT_DIR/<exp>/slurm-<job id>)
#   FTCORE_MAX_REQUEUES   requeues allowed after exit 3 (default 20)
#   FTCORE_PYTHON         the python that runs ftcore on the nodes (default: the project's venv,
#                         <repo>/.venv/bin/python, when it exists and no container is used;
#                         else python on PATH). The job log names the one used.
#   FTCORE_MODULE         what the workers run (default ftcore.train; e.g. ftcore.eval)
#   FTCORE_SRUN_ARGS      extra srun flags, e.g. "--mpi=pmix" (none by default: no PMI is needed)
#   FTCORE_CONTAINER_IMAGE    run the launcher in a container (off by default):
#   FTCORE_CONTAINER_RUNTIME  pyxis (srun --container-image, default) or apptainer
#   FTCORE_CONTAINER_MOUNTS   comma-separated binds (default: the submit dir and the output dir)
#   FTCORE_DRY_RUN=1      print the srun command and the resolved layout of node 0; start nothing

ftcore_log() { echo "ftcore[$(date +%H:%M:%S)]: $*"; }

# The repository this file belongs to (its venv is the default python).
FTCORE_REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

# _ftcore_python: set FTCORE_PY (the python that runs ftcore) and FTCORE_PY_WHY (where it came from):
# FTCORE_PYTHON if set; else the project's venv, so that `make train`'s install is what runs even
# when the venv is not active (inside a container the image's python is used instead); else the
# python on PATH.
_ftcore_python() {
	if [[ -n ${FTCORE_PYTHON:-} ]]; then
		FTCORE_PY=$FTCORE_PYTHON FTCORE_PY_WHY="FTCORE_PYTHON"
	elif [[ -z ${FTCORE_CONTAINER_IMAGE:-} && -x $FTCORE_REPO/.venv/bin/python ]]; then
		FTCORE_PY=$FTCORE_REPO/.venv/bin/python FTCORE_PY_WHY="the project's venv; FTCORE_PYTHON overrides it"
	else
		FTCORE_PY=python FTCORE_PY_WHY="on PATH: $(command -v python || echo "not found"); FTCORE_PYTHON overrides it"
	fi
}

# _ftcore_refuse PATH WHAT: the one error line (exit 2, never requeued) for a path not ours.
_ftcore_refuse() {
	echo "ftcore error: run.dir: $1 $2: a run directory someone else made (or a link in it) is never" \
		"written to -- fix: FTCORE_RUN_DIR=<a new directory of yours>, or remove $1" >&2
	return 2
}

# _ftcore_private_dir DIR: create DIR readable by this user only (0700) unless it exists; exit
# status 2 when it is a link, not a directory, or another user's.
_ftcore_private_dir() {
	local d=$1
	if [[ ! -e $d && ! -L $d ]]; then
		mkdir -p -- "$(dirname -- "$d")" || return 1
		mkdir -m 700 -- "$d" 2>/dev/null || [[ -e $d ]] || return 1
	fi
	[[ -L $d ]] && { _ftcore_refuse "$d" "is a symbolic link"; return; }
	[[ -d $d ]] || { _ftcore_refuse "$d" "is not a directory"; return; }
	[[ -O $d ]] || { _ftcore_refuse "$d" "belongs to another user"; return; }
	return 0
}

# _ftcore_own_file FILE: nothing there yet, or a plain file of this user's (status 2 otherwise).
_ftcore_own_file() {
	local f=$1
	[[ -e $f || -L $f ]] || return 0
	[[ -L $f ]] && { _ftcore_refuse "$f" "is a symbolic link"; return; }
	[[ -f $f && -O $f ]] || { _ftcore_refuse "$f" "is not a file of yours"; return; }
	return 0
}

# _ftcore_private_output: the job's SLURM output file (created by slurmd with the submitter's
# umask) readable by this user only, like logs/job.log.
_ftcore_private_output() {
	[[ -n ${SLURM_JOB_ID:-} ]] && command -v scontrol >/dev/null || return 0
	local out
	out=$(scontrol show job "$SLURM_JOB_ID" 2>/dev/null | sed -n 's/^ *StdOut=//p')
	[[ -n $out && -f $out && ! -L $out && -O $out ]] && chmod go-rwx -- "$out"
	return 0
}

_ftcore_on_signal() {
	FTCORE_GOT_SIGNAL=$1
	[[ $1 == TERM ]] && FTCORE_TERMINATED=1
	ftcore_log "got SIG$1: asking the trainer to stop at the next step boundary ($FTCORE_STOP_FILE)"
	touch "$FTCORE_STOP_FILE"
}

# _ftcore_step NTASKS: fill FTCORE_SRUN (srun and its flags, one task per node) and FTCORE_PREFIX
# (what runs python: empty, or an apptainer command) from the settings above.
_ftcore_step() {
	local ntasks=$1 submit_dir=${SLURM_SUBMIT_DIR:-$PWD}
	FTCORE_SRUN=(srun "--nodes=$ntasks" "--ntasks=$ntasks" --ntasks-per-node=1 --kill-on-bad-exit=1)
	FTCORE_PREFIX=()
	# srun >= 22.11 no longer inherits --cpus-per-task from sbatch: pass it on explicitly
	[[ -n ${SLURM_CPUS_PER_TASK:-} ]] && FTCORE_SRUN+=("--cpus-per-task=$SLURM_CPUS_PER_TASK")
	if [[ -n ${FTCORE_SRUN_ARGS:-} ]]; then
		local -a extra
		read -r -a extra <<<"$FTCORE_SRUN_ARGS"
		FTCORE_SRUN+=("${extra[@]}")
	fi
	[[ -n ${FTCORE_CONTAINER_IMAGE:-} ]] || return 0
	local out=${FTCORE_OUTPUT_DIR:-$submit_dir/outputs} mounts=$submit_dir:$submit_dir
	[[ $out == "$submit_dir"/* ]] || mounts+=",$out:$out"
	mounts=${FTCORE_CONTAINER_MOUNTS:-$mounts}
	case ${FTCORE_CONTAINER_RUNTIME:-pyxis} in
	pyxis) FTCORE_SRUN+=("--container-image=$FTCORE_CONTAINER_IMAGE" "--container-mounts=$mounts"
		"--container-workdir=$submit_dir") ;;
	apptainer) FTCORE_PREFIX=(apptainer exec --nv --bind "$mounts" --pwd "$submit_dir" "$FTCORE_CONTAINER_IMAGE") ;;
	*)
		ftcore_log "FTCORE_CONTAINER_RUNTIME must be pyxis or apptainer, not ${FTCORE_CONTAINER_RUNTIME}"
		return 2
		;;
	esac
}

# ftcore_run EXP NPROC_PER_NODE [OVERRIDES...]: run experiment EXP (conf/exp/EXP.yaml) with
# NPROC_PER_NODE workers per node (a number, or auto: the GPUs SLURM gave each node).
ftcore_run() {
	local exp=${1:?usage: ftcore_run EXP NPROC_PER_NODE [OVERRIDES...]} nproc=${2:?}
	shift 2
	_ftcore_python
	local python=$FTCORE_PY
	local module=${FTCORE_MODULE:-ftcore.train}
	local job=${SLURM_JOB_ID:-local-$(date +%Y%m%d-%H%M%S)}
	local out=${FTCORE_OUTPUT_DIR:-${SLURM_SUBMIT_DIR:-$PWD}/outputs}
	local run_dir=${FTCORE_RUN_DIR:-$out/$exp/slurm-$job}
	local restarts=${SLURM_RESTART_COUNT:-0}
	local max_requeues=${FTCORE_MAX_REQUEUES:-20}
	FTCORE_STOP_FILE=$run_dir/STOP

	_ftcore_step "${SLURM_JOB_NUM_NODES:-1}" || return
	local -a opts=("--nproc-per-node=$nproc" --module "$module")
	local -a overrides=("+exp=$exp" "run.dir=$run_dir" "run.stop_file=$FTCORE_STOP_FILE"
		checkpoint.resume=auto)
	# a run directory derived from the job id belongs to this job alone: its checkpoints record
	# the id, and resume=auto refuses another job's (a recycled id, another cluster's)
	[[ -z ${FTCORE_RUN_DIR:-} && -n ${SLURM_JOB_ID:-} ]] &&
		overrides+=("run.id=slurm:${SLURM_CLUSTER_NAME:-}:$SLURM_JOB_ID")
	overrides+=("$@") # the user's overrides come last, so they win
	local -a srun=("${FTCORE_SRUN[@]}")
	local -a launcher=("${FTCORE_PREFIX[@]}" "$python" -m ftcore.launch.node "${opts[@]}" -- "${overrides[@]}")

	if [[ -n ${FTCORE_DRY_RUN:-} ]]; then
		ftcore_log "python: $python ($FTCORE_PY_WHY)"
		printf 'srun command:'
		printf ' %q' "${srun[@]}" "${launcher[@]}"
		printf '\n'
		# the rendezvous port is drawn from a secret when the job starts: none to print here
		FTCORE_RENDEZVOUS_SECRET='' SLURM_NODEID=0 "$python" -m ftcore.launch.node "${opts[@]}" --dry-run -- "${overrides[@]}"
		return
	fi
	# A secret per attempt, never written anywhere: srun passes it to every node's launcher, which
	# draws the rendezvous port from it (launch/slurm_env.py), so the port is not the job id's.
	FTCORE_RENDEZVOUS_SECRET=$(od -An -tx1 -N16 /dev/urandom | tr -d ' \n') || return 1
	export FTCORE_RENDEZVOUS_SECRET

	# Nothing is written into a run directory before it is known to be this user's own: one
	# pre-created by someone else (job ids are public) could hold links to their victims' files.
	_ftcore_private_dir "$run_dir" || return
	_ftcore_private_dir "$run_dir/logs" || return
	_ftcore_own_file "$run_dir/logs/job.log" || return
	_ftcore_own_file "$FTCORE_STOP_FILE" || return
	rm -f "$FTCORE_STOP_FILE" # a stop request belongs to the attempt that made it
	_ftcore_private_output
	exec > >(umask 077 && exec tee -a "$run_dir/logs/job.log") 2>&1
	local tee_pid=$!
	ftcore_log "job $job (restart $restarts) on ${SLURM_JOB_NODELIST:-$(hostname)}: exp=$exp run.dir=$run_dir"
	ftcore_log "python: $python ($FTCORE_PY_WHY)"

	FTCORE_GOT_SIGNAL="" FTCORE_TERMINATED=0
	trap '_ftcore_on_signal USR1' USR1
	trap '_ftcore_on_signal TERM' TERM
	"${srun[@]}" "${launcher[@]}" &
	local pid=$! rc
	# A trap interrupts `wait` (status > 128) while the step runs on: wait again until it is over.
	while :; do
		FTCORE_GOT_SIGNAL=""
		wait "$pid"
		rc=$?
		[[ -n $FTCORE_GOT_SIGNAL ]] && ((rc > 128)) && continue
		break
	done
	trap - USR1 TERM

	if ((rc == 3)) && ((FTCORE_TERMINATED)); then
		ftcore_log "step exited 3 after SIGTERM: checkpoint saved; SLURM decides whether the job comes back"
	elif ((rc == 3)) && ((restarts >= max_requeues)); then
		ftcore_log "step exited 3 but the job was already requeued $restarts times (FTCORE_MAX_REQUEUES=$max_requeues): not requeueing"
	elif ((rc == 3)); then
		ftcore_log "step exited 3 (stopped after saving a checkpoint): requeueing job $job"
		scontrol requeue "$job" || ftcore_log "scontrol requeue $job failed"
	else
		ftcore_log "step exited $rc: $( ((rc == 0)) && echo "done" || echo "not requeueing")"
	fi
	exec >&- 2>&- # let tee see the end of the log, then wait for it to flush
	wait "$tee_pid" 2>/dev/null
	return "$rc"
}

# ftcore_once MODULE [ARGS...]: run `python -m MODULE ARGS` once, on the first node, as one SLURM
# task (ftcore.bench starts its own workers). No stop file, no requeue: a benchmark is redone whole.
ftcore_once() {
	local module=${1:?usage: ftcore_once MODULE [ARGS...]}
	shift
	_ftcore_step 1 || return
	_ftcore_python
	local -a cmd=("${FTCORE_SRUN[@]}" "${FTCORE_PREFIX[@]}" "$FTCORE_PY" -m "$module" "$@")
	ftcore_log "python: $FTCORE_PY ($FTCORE_PY_WHY)"
	if [[ -n ${FTCORE_DRY_RUN:-} ]]; then
		printf 'srun command:'
		printf ' %q' "${cmd[@]}"
		printf '\n'
		return
	fi
	ftcore_log "job ${SLURM_JOB_ID:-local} on ${SLURM_JOB_NODELIST:-$(hostname)}: python -m $module $*"
	"${cmd[@]}"
}
