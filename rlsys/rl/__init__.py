"""One RL step as phases over a typed batch: rollout (generate, score), the rows, the trainer's passes,
rewards per token, advantages, the update, the weight sync. Features (KL in the reward, distillation,
the critic, ReMax, router replay, the optimal token baselines, rollout corrections) are extensions
that declare the fields they read and hook the phases (`extension.py`)."""
