"""Imported by the fork server of launch/fork.py alone (its first preload), for this one effect: the
fork server and every child forked from it ignore SIGTERM and SIGHUP (multiprocessing already makes
the fork server ignore SIGINT; launch/fork.py's children ignore it too).

Why: a terminal's Ctrl-C, a hang-up and coreutils `timeout` signal the whole process group, so the
children and the fork server would otherwise die at the same instant as the parent is told to stop.
A child killed so answers nothing, and once the fork server is dead multiprocessing reads every
child's exit code as 255: the record would say "a child died" instead of why the run stopped. The
parent alone decides: its handler notes the signal (harness/run/signals.py), its poll loop ends every
child (SIGKILL) and records `interrupted` or `timeout` with the cause. Nothing is left behind: the
fork server exits when the parent does (multiprocessing's alive pipe), and each child dies with the
fork server (PR_SET_PDEATHSIG, launch/fork.py).
"""
import signal

for _sig in (signal.SIGTERM, signal.SIGHUP):
    signal.signal(_sig, signal.SIG_IGN)
