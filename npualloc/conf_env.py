"""The environment variables the library reads its config from, and how
npualloc's commands hand a --conf to the program they start. The library
parses it (interpose/src/hook/lifecycle.c: the first variable set to
something wins; one set empty counts as unset, as MindTorch reads its own)
and warns on stderr about every key it refuses, so `run --conf` and
`replay --conf` share one parser and the same warnings."""
from __future__ import annotations

from collections.abc import Mapping

# In the order the library looks at them.
CONF_VARIABLES = ("MINDTORCH_NPU_ALLOC_CONF", "PYTORCH_NPU_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")
# What the library's parser skips around and between entries (C's isspace,
# interpose/src/core/config.c's trim) and the comma that ends each.
_NO_ENTRY = " \t\n\v\f\r,"


def configured(env: Mapping[str, str]) -> bool:
    """Whether env sets the allocator's config (a variable set empty does not)."""
    return any(env.get(name) for name in CONF_VARIABLES)


def with_conf(env: Mapping[str, str], conf: str, command: str, keep_users: bool = False) -> dict[str, str]:
    """env with conf in the variable the library will read, and
    NPUALLOC_CONF_FROM naming the npualloc command, so the library's config
    warnings say `npualloc <command> --conf` rather than a variable the user
    never set. keep_users (run's): conf goes after the keys the variable
    already holds, so theirs stay and conf's win for a key in both (the
    later of a repeated key wins, in torch's parser and the library's), and
    the warnings name both (NPUALLOC_CONF_FROM=<command>+variable). A value
    with no entry (blanks and commas only) keeps nothing: the library still
    reads that variable and looks no further (as MindTorch does), so conf
    goes there alone, and the warnings name only the command. An empty
    conf is no config: every variable goes, or the library would read the
    next one set."""
    result = dict(env)
    result["NPUALLOC_CONF_FROM"] = command
    if conf:
        variable = next((k for k in CONF_VARIABLES if result.get(k)), None)
        users = result[variable].rstrip(_NO_ENTRY) if variable is not None and keep_users else ""
        if users.lstrip(_NO_ENTRY):
            conf = f"{users},{conf}"  # no empty entry between: the program parses the variable too
            result["NPUALLOC_CONF_FROM"] = f"{command}+variable"
        result[variable or CONF_VARIABLES[0]] = conf
    else:
        for name in CONF_VARIABLES:
            result.pop(name, None)
    return result
