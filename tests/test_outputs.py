from pagedllm.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput


def test_completion_finished_and_request_output_shape():
    c = CompletionOutput(index=0, text="hi", token_ids=[5, 6])
    assert not c.finished() and c.cumulative_logprob is None and c.logprobs is None
    c.finish_reason, c.stop_reason = "stop", "\n"
    assert c.finished()
    lp = Logprob(logprob=-0.5, rank=1, decoded_token="hi")
    c.logprobs = [{5: lp}]
    out = RequestOutput("r1", "say hi", [1, 2], [c], finished=True, metrics=RequestMetrics(arrival_time=1.0))
    assert out.outputs[0].logprobs[0][5].rank == 1
    assert out.metrics.first_token_time is None and out.metrics.num_preemptions == 0
    assert "request_id='r1'" in repr(out)
