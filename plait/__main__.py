import sys

from plait.cli import main
from plait.runtime.launch import exit_rank, in_torchrun

code = main()
if in_torchrun():
    exit_rank(code)  # a rank ends once its work is written, not in the interpreter's teardown
sys.exit(code)
