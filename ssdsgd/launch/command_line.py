"""How a role runs the job's command: as given (an argv), or through bash where MXNet's launcher would
need its shell for it.

MXNet's launcher (dmlc tracker) always joins the command with spaces and runs it with `bash -c`, after
turning a first word naming a file in the working directory into `./word`. Here an argv that needs no
shell is executed as it is, which keeps an argument with spaces in it whole (MXNet's would split it);
the rest runs through bash the way MXNet's launcher runs it:
- one word with shell syntax in it: a command line (`launch.py -n 2 "FOO=1 python x.py > out"`);
- a first word `NAME=value`: an inline environment assignment (`launch.py -n 2 FOO=1 python x.py`);
- a word with shell operators or expansions (`;`, `|`, `&`, `<`, `>`, `$`, a backquote, `*`, `?`) and no
  space or quote: left for the shell, as MXNet's launcher leaves it. Words with spaces or quotes are
  quoted, so they stay one argument, and so are words with parentheses but no operator (`f(x)`, which
  bash would take for a syntax error; `$(cmd)` stays for the shell).
A first word naming a file in the working directory runs as `./word`, as MXNet's launcher runs it.
"""
import os
import re
import shlex
import sys

SHELL_WORD = re.compile(r'[\s;&|<>$`\'"*?()]')   # in a one-word command: a shell command line
SHELL_OPERATOR = re.compile(r'[;&|<>$`*?]')
QUOTED = re.compile(r'[\s\'"]')
PARENS = re.compile(r'[()]')
ASSIGNMENT = re.compile(r'[A-Za-z_][A-Za-z0-9_]*=')
SHELL = 'bash'   # what MXNet's launcher runs commands with (its local and its scheduler's `bash -c`)


def with_interpreter(command, python):
    """A command starting with `python`, `python3` or the launching interpreter runs `python` instead:
    roles use the launching interpreter (and its virtual environment) unless the host file names one."""
    if command and command[0] in ('python', 'python3', sys.executable):
        return [python] + list(command[1:])
    return list(command)


def needs_shell(command):
    if len(command) == 1:
        return bool(SHELL_WORD.search(command[0]) or ASSIGNMENT.match(command[0]))
    return bool(ASSIGNMENT.match(command[0])) or any(SHELL_OPERATOR.search(w) and not QUOTED.search(w)
                                                     for w in command)


def role_argv(command, python, cwd):
    """The argv a role executes for the job's `command` (a list of words), with `python` as its
    interpreter, in the working directory `cwd`."""
    words = with_interpreter(command, python)
    first = words[0]
    if '/' not in first and not ASSIGNMENT.match(first) and os.path.isfile(os.path.join(cwd, first)):
        words[0] = './' + first
    if not needs_shell(words):
        return words
    if len(words) == 1:
        return [SHELL, '-c', words[0]]
    return [SHELL, '-c', ' '.join(shlex.quote(w) if _quoted(w) else w for w in words)]


def _quoted(word):
    """Whether a word of a command run through bash is quoted (kept one literal argument)."""
    return bool(QUOTED.search(word) or (PARENS.search(word) and not SHELL_OPERATOR.search(word)))
