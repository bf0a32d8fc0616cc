"""A serving process freezes its start-up heap once (serve_app/runtime/heap.py)."""

import subprocess
import sys

from tests.conftest import REPO


def test_start_up_objects_are_frozen_once_and_later_garbage_stays_collectable():
    script = (
        "import gc\n"
        "from serve_app.runtime import heap\n"
        "kept = [object() for _ in range(1000)]\n"
        "heap.freeze_startup()\n"
        "first = gc.get_freeze_count()\n"
        "later = [[] for _ in range(1000)]\n"
        "heap.freeze_startup()\n"
        "print(first, gc.get_freeze_count())\n"
    )
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, check=True)
    first, second = map(int, done.stdout.split())
    assert first > 0  # start-up's objects are in the permanent generation
    assert second == first  # a second call pins nothing more
