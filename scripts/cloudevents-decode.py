"""Decodes broker messages with the CloudEvents SDK for Python (PyPI cloudevents 2.2.0, its protocol
bindings), as a consumer built for CloudEvents would: the tests of the message formats feed it what a
broker delivered and compare what the SDK reads with the events that were published.

Input, one JSON object per line on standard input:
  {"binding": "kafka" | "amqp" | "rabbitmq" | "http",
   "headers": {name: value}, "key": str | null, "content_type": str | null, "body_b64": str}
(amqp: the headers are the application properties, content_type the message property; rabbitmq:
Knative's RabbitMQ binding, ce- headers; http: the HTTP binding's headers, as SQS attributes carry them.)
Output, one JSON object per line: {"attributes": {...}, "data": ..., "data_b64": ...} or {"error": "..."}.
The binding picks binary or structured mode itself, from the content type, as consumers do.
"""
import base64
import datetime
import json
import sys

from cloudevents.core.bindings import amqp, http, kafka, rabbitmq
from cloudevents.core.formats.json import JSONFormat


def decode(request):
    body = base64.b64decode(request["body_b64"])
    headers = request.get("headers") or {}
    binding = request["binding"]
    if binding == "kafka":
        message = kafka.KafkaMessage(
            headers={k: v.encode() for k, v in headers.items()},
            key=request.get("key"),
            value=body,
        )
        return kafka.from_kafka_event(message, JSONFormat())
    if binding == "amqp":
        properties = {}
        if request.get("content_type"):
            properties["content-type"] = request["content_type"]
        message = amqp.AMQPMessage(
            properties=properties, application_properties=headers, application_data=body
        )
        return amqp.from_amqp_event(message, JSONFormat())
    if binding == "rabbitmq":
        message = rabbitmq.RabbitMQMessage(
            headers=headers, content_type=request.get("content_type"), body=body
        )
        return rabbitmq.from_rabbitmq_event(message, JSONFormat())
    if binding == "http":
        return http.from_http_event(http.HTTPMessage(headers=headers, body=body), JSONFormat())
    raise ValueError(f"unknown binding {binding!r}")


def plain(value):
    if isinstance(value, datetime.datetime):
        return value.isoformat()
    if isinstance(value, bytes):
        return base64.b64encode(value).decode()
    return value


for line in sys.stdin:
    if not line.strip():
        continue
    try:
        event = decode(json.loads(line))
        data = event.get_data()
        out = {"attributes": {k: plain(v) for k, v in event.get_attributes().items()}}
        if isinstance(data, bytes):
            out["data_b64"] = base64.b64encode(data).decode()
        else:
            out["data"] = data
    except Exception as e:  # every failure is reported, per message
        out = {"error": f"{type(e).__name__}: {e}"}
    print(json.dumps(out), flush=True)
