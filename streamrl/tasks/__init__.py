"""streamrl.tasks: prompt sources and reward rules (built-in digit tasks, JSONL datasets)."""

from streamrl.tasks.base import Prompt, RewardFn, Task, batch_reward
from streamrl.tasks.dataset import (
    DatasetTask,
    PromptDatasetError,
    check_prompts_jsonl,
    iter_prompts_jsonl,
    load_prompts_jsonl,
)
from streamrl.tasks.digits import DigitsReverseTask, FirstDigitTask, positional_score
from streamrl.tasks.registry import (
    TaskOptionError,
    UnknownTaskError,
    check_task,
    get_task,
    register_task,
    task_names,
)

__all__ = [
    "DatasetTask",
    "DigitsReverseTask",
    "FirstDigitTask",
    "Prompt",
    "PromptDatasetError",
    "RewardFn",
    "Task",
    "TaskOptionError",
    "UnknownTaskError",
    "batch_reward",
    "check_prompts_jsonl",
    "check_task",
    "get_task",
    "iter_prompts_jsonl",
    "load_prompts_jsonl",
    "positional_score",
    "register_task",
    "task_names",
]
