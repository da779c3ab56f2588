"""Why a path a job is given cannot be used, in words, found without creating anything: the front end,
--dry-run and the run then say the same thing, and say what the path is where the errno would mislead
("File exists" for a symbolic link loop, "file not found" for a folder). Standard library only.
"""
import errno
import os

NAME_MAX = 255            # bytes in one name of a path (Linux file systems)


def _link_problem(path):
    """A symbolic link that leads nowhere: what it is, or None."""
    if not os.path.islink(path) or os.path.exists(path):
        return None
    try:
        os.stat(path)
    except OSError as err:
        if err.errno == errno.ELOOP:
            return f"{path} is a symbolic link loop"
    return f"{path} is a symbolic link to {os.readlink(path)}, which does not exist"


def file_problem(path):
    """Why `path` is not a file to read, or None."""
    if os.path.isfile(path):
        return None if os.access(path, os.R_OK) else f"{path} cannot be read (permission denied)"
    if os.path.isdir(path):
        return f"{path} is a folder, not a file"
    if os.path.exists(path):
        return f"{path} is not a regular file"
    return _link_problem(path) or f"{path} does not exist"


def folder_problem(folder):
    """Why a folder cannot be made, or written in, at `folder`; or None."""
    path = os.path.abspath(folder)
    for name in path.split(os.sep):
        if len(name.encode()) > NAME_MAX:
            return f"{name[:20]}... is a name of {len(name.encode())} bytes (a folder name has at most {NAME_MAX})"
    nearest = path                     # the path's longest part that is there (a dangling link is)
    while not os.path.lexists(nearest):
        nearest = os.path.dirname(nearest)
    problem = _link_problem(nearest)
    if problem:
        return problem
    if not os.path.isdir(nearest):
        return f"{nearest} is a file, not a folder"
    if not os.access(nearest, os.W_OK | os.X_OK):
        return f"{nearest} is not writable (permission denied)"
    return None
