"""Trainer integrations: ``treepack.integrations.trl`` (TRL's GRPOTrainer, packed). Each imports its trainer, so
import the one you use."""
