"""schemathesis hooks for scripts/schemathesis: the fuzzer may revoke the tokens it creates,
never the ones the run depends on (its own admin token, the agents' join token), whose names
ZT_PROTECTED_TOKENS lists."""

import os

import schemathesis

PROTECTED = set(filter(None, os.environ.get("ZT_PROTECTED_TOKENS", "").split(",")))


@schemathesis.hook
def before_call(context, case, kwargs):
    if case.operation.label == "DELETE /v1/tokens/{name}":
        if case.path_parameters.get("name") in PROTECTED:
            case.path_parameters["name"] = "no-such-token"
