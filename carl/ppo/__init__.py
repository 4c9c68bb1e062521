"""PPO for CaRL: rollout storage + GAE (:mod:`.storage`), the loss (:mod:`.loss`) and the iteration (:mod:`.trainer`)."""
from carl.ppo.loss import LossTerms, normalize_advantages, ppo_loss
from carl.ppo.storage import RolloutStorage, compute_gae
from carl.ppo.trainer import PPOTrainer

__all__ = ["LossTerms", "PPOTrainer", "RolloutStorage", "compute_gae", "normalize_advantages", "ppo_loss"]
