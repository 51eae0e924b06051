"""The per-user folders, in one place: where a run's outputs and compiled kernels go.

`platformdirs` knows each platform's convention (on Linux `$XDG_CACHE_HOME/fa4tune`, else
`~/.cache/fa4tune`; on macOS `~/Library/Caches/fa4tune`); an environment variable names another
folder. Nothing here creates a folder: the writer that needs one does.

    results_dir()        $FA4TUNE_HOME, else the user cache folder: the user's best-config database
                         (`fa4.database.user_path`), the search journal, benches, reports
    kernel_cache_dir()   $FA4TUNE_CACHE_DIR, else `kernels` in the user cache folder (`fa4.compile_cache`)
"""

from __future__ import annotations

import os
from pathlib import Path

APP_NAME = "fa4tune"
HOME_ENV_VAR = "FA4TUNE_HOME"
KERNEL_CACHE_ENV_VAR = "FA4TUNE_CACHE_DIR"


def user_cache_dir() -> Path:
    import platformdirs  # here: `import fa4` stays cheap

    return Path(platformdirs.user_cache_dir(APP_NAME, appauthor=False))


def results_dir() -> Path:
    home = os.environ.get(HOME_ENV_VAR)
    return Path(home).expanduser() if home else user_cache_dir()


def kernel_cache_dir() -> Path:
    folder = os.environ.get(KERNEL_CACHE_ENV_VAR)
    return Path(folder).expanduser() if folder else user_cache_dir() / "kernels"
