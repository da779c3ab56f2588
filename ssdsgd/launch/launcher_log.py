"""launcher.log: what ssdsgd-run and the launcher say of a job (a role that died and where, its last lines,
restarts, the cleanup), copied from the front end's stderr into the run folder, a whole line or none. The
roles' own output goes to stdout and the metrics."""
import contextlib
import os
import shlex
import sys
import time

from ssdsgd.metrics import LAUNCHER_LOG_FILE, WriteError, append_whole, write_problem


class LauncherLog:
    """The run folder's launcher.log, open for appending (fd None once a write failed)."""

    def __init__(self, path, fd):
        self.path, self.fd = path, fd

    def append(self, text):
        """Append whole lines; on a full disk say so once (WriteError's line, on `stream`) and write no more."""
        if self.fd is None:
            return None
        try:
            append_whole(self.fd, text.encode(), self.path)
        except WriteError as err:
            self.close()
            return f"run: {err}; the job's further messages are on this terminal only"
        return None

    def close(self):
        if self.fd is not None:
            fd, self.fd = self.fd, None
            try:
                os.close(fd)
            except OSError:
                pass


def open_launcher_log(run_dir, command):
    """launcher.log in run_dir, opened and its first line written (the date and `command`). WriteError naming
    the file and the free space if it cannot be (a full disk): no file is left then, or the one that was there
    stays as it was."""
    path = os.path.join(run_dir, LAUNCHER_LOG_FILE)
    existed = os.path.exists(path)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
    except OSError as err:
        raise WriteError(f"cannot write {path}: {write_problem(err, path)}") from None
    try:
        append_whole(fd, f"{time.strftime('%Y-%m-%dT%H:%M:%S%z')} {shlex.join(command)}\n".encode(), path)
    except WriteError:
        os.close(fd)
        if not existed:
            with contextlib.suppress(OSError):
                os.remove(path)
        raise
    return LauncherLog(path, fd)


class Tee:
    """sys.stderr that also appends each whole line to a LauncherLog. Writing the copy may fail (a full disk):
    the terminal still gets every line, and one more that says the copy stopped there."""

    def __init__(self, stream, log):
        self.stream, self.log, self.pending = stream, log, ""

    def write(self, text):
        self.stream.write(text)
        self.pending += text
        if "\n" in self.pending:
            whole, _, self.pending = self.pending.rpartition("\n")
            self._copy(whole + "\n")
        return len(text)

    def _copy(self, text):
        said = self.log.append(text)
        if said:
            self.stream.write(said + "\n")
            self.stream.flush()

    def flush(self):
        self.stream.flush()

    def __getattr__(self, name):
        return getattr(self.stream, name)


@contextlib.contextmanager
def messages_also_in(log):
    """sys.stderr copied into `log` (a LauncherLog) while the block runs; closed at its end."""
    stream = sys.stderr
    sys.stderr = tee = Tee(stream, log)
    try:
        yield
    finally:
        sys.stderr = stream
        if tee.pending:
            tee._copy(tee.pending + "\n")
        log.close()
