"""A stand-in for torch in the sweep's stub tests: only what run_all.sh asks of the
machine, from machine.json in the folder above ([GPUs, GiB each, name])."""

import json
import os

_GPUS, _GIB, _NAME = json.load(open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "machine.json")))
__version__ = "stub"


class _Properties:
    total_memory = _GIB * 2**30
    name = _NAME


class cuda:
    @staticmethod
    def is_available():
        return _GPUS > 0

    @staticmethod
    def device_count():
        return _GPUS

    @staticmethod
    def get_device_properties(index):
        return _Properties
