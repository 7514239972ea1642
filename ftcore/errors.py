"""One error type for everything the user can fix, and the exit statuses of docs/design.md."""

EXIT_OK = 0
EXIT_USER_ERROR = 2  # FtcoreError: config, data, paths, hardware, predicted OOM
EXIT_REQUEUE = 3  # stopped on a signal or run.max_time after saving a checkpoint


class FtcoreError(Exception):
    """A user error: one line naming the field or file and the fix. Exit status 2, no traceback."""

    def __init__(self, message: str, *, field: str | None = None, fix: str | None = None):
        self.field = field
        self.fix = fix
        parts = [f"{field}: {message}" if field else message]
        if fix:
            parts.append(f"fix: {fix}")
        super().__init__(" -- ".join(parts))


class StopRequested(Exception):
    """Raised after a checkpoint was saved because of a signal, a stop file or run.max_time."""

    def __init__(self, step: int, reason: str, resume: str | None = None):
        self.step = step
        self.reason = reason
        self.resume = resume  # the command that continues the run (runtime.signals.resume_command)
        msg = f"stopped at step {step} ({reason}); checkpoint saved, exit 3 to requeue"
        super().__init__(msg + (f"; resume with: {resume}" if resume else ""))
