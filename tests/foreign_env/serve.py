"""affinetes' own template server (the one its images run) serving env.py beside this file instead of /app/env.py:
`python -m uvicorn serve:app --app-dir tests/foreign_env --port PORT`."""
from pathlib import Path

from ppo_affine.testing.template_server import serve_env_file

app = serve_env_file(Path(__file__).with_name("env.py"))
