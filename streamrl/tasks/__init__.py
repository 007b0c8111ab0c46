"""streamrl.tasks: prompt sources and reward rules (built-in digit tasks, JSONL datasets)."""

from streamrl.tasks.base import Prompt, RewardFn, Task, batch_reward
from streamrl.tasks.dataset import DatasetTask, PromptDatasetError, load_prompts_jsonl
from streamrl.tasks.digits import DigitsReverseTask, FirstDigitTask, positional_score
from streamrl.tasks.registry import TaskOptionError, UnknownTaskError, get_task, register_task, task_names

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
    "get_task",
    "load_prompts_jsonl",
    "positional_score",
    "register_task",
    "task_names",
]
