"""Evaluating language models as the field does: lm-eval-harness's tasks on a jaxtrain model on any mesh.

`harness` is lm-eval's model `jaxtrain` (`python -m jaxtrain.evaluation --model jaxtrain ...`), `scoring` its batched
log-likelihood program, `tokenization` its tokenizer conventions (the `hf` backend's), `tasks` lm-eval's tasks by
name, local ones included, and `in_loop` the tasks inside training (`train.eval_tasks`). lm-eval-harness is the
optional `eval` extra: nothing here imports it until a task is asked for.
"""
