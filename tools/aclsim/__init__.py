"""`import aclsim` with tools/ on sys.path (as conftest.sim_env() sets it):
the sim's introspection wrapper, see aclsim.py."""
from .aclsim import *  # noqa: F401,F403
