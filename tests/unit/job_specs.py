"""Job specs unit tests build: one place for the common shapes."""

from shardline.ps_server.optimizer import OptimizerConfig
from shardline.services.pb import common_pb2


def one_tensor_spec(world_size: int, kind: str, block: int, **hyperparameters) -> common_pb2.JobSpec:
    """A BSP job "j" of one fp32 tensor "w" of two blocks of ``block`` elements."""
    s = common_pb2.JobSpec(name="j", sync="bsp", world_size=world_size, block_elements=block,
                           optimizer=OptimizerConfig.from_kwargs(kind, **hyperparameters).to_proto())
    s.tensors.add(name="w", shape=[2 * block], dtype="float32", trainable=True)
    return s
