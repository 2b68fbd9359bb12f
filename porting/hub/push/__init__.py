"""`port publish --push`: upload a published folder to the Hugging Face Hub or ModelScope through their own clients,
then check that what landed is what was validated."""

from .engine import PushResult, preflight, push_folder
from .target import PUSH_HUBS, PushTarget, push_target

__all__ = ["PUSH_HUBS", "PushResult", "PushTarget", "preflight", "push_folder", "push_target"]
