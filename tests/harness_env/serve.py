"""affinetes' own template server (the one its images run) serving the harness env, env.py beside this file,
instead of /app/env.py: `python -m uvicorn serve:app --app-dir tests/harness_env --port PORT`."""
import importlib.util
import sys
from pathlib import Path

import affinetes.templates.http_server as template

ENV_FILE = Path(__file__).with_name("env.py")


def _load_env_beside_this_file():
    spec = importlib.util.spec_from_file_location("user_env", ENV_FILE)
    module = importlib.util.module_from_spec(spec)
    sys.modules["user_env"] = module
    spec.loader.exec_module(module)
    template.user_module, template.user_actor = module, None


template._load_user_env = _load_env_beside_this_file  # the startup hook looks it up by name when it runs
app = template.app
