"""Evaluation tasks shared by the eval gate, the simulated users and the tiny model.

`evals.tasks`: synthetic tasks (prompts, a fixed held-out split, a preference function that plays
the user); `evals.scoring`: a completion's reward under a reward spec.
"""

from evals.scoring import Scorer, scorer
from evals.tasks import TASKS, Preference, Task, TaskError, get_task, load_preference

__all__ = ["TASKS", "Preference", "Scorer", "Task", "TaskError", "get_task", "load_preference", "scorer"]
