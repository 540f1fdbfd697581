"""affinetes' own template server (the one its images run) serving an env.py of the tests instead of /app/env.py."""
import importlib.util
import sys
from pathlib import Path


def serve_env_file(env_file: Path):
    """affinetes' template app, its startup hook pointed at `env_file`; run it with uvicorn."""
    import affinetes.templates.http_server as template

    def load_env_file():
        spec = importlib.util.spec_from_file_location("user_env", env_file)
        module = importlib.util.module_from_spec(spec)
        sys.modules["user_env"] = module
        spec.loader.exec_module(module)
        template.user_module, template.user_actor = module, None

    template._load_user_env = load_env_file  # the startup hook looks it up by name when it runs
    return template.app
