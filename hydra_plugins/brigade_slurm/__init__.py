"""Registers brigade's SLURM launcher with Hydra, which accepts plugins only from the hydra_plugins
package; the implementation (and why it subclasses Hydra's submitit launcher) is in launch/slurm.py."""
from launch.slurm import BrigadeSlurmLauncher as _Impl


class BrigadeSlurmLauncher(_Impl):
    pass
