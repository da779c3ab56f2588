"""Writes what this role sees (its DMLC_* variables, FOO, the working directory) to role.<pid>.json in the
working directory, and prints one line; no MXNet, so any launcher's roles run it in a second."""
import json
import os

seen = {k: v for k, v in os.environ.items() if k.startswith("DMLC_") or k == "FOO"}
seen["cwd"] = os.getcwd()
with open(os.path.join(os.getcwd(), f"role.{os.getpid()}.json"), "w") as f:
    json.dump(seen, f)
print(f"role {seen['DMLC_ROLE']} foo {seen.get('FOO', '-')}", flush=True)
