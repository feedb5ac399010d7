//! Destination administration for tools (`outbox bench`, set-up scripts), as `txoutbox_kafka::admin` and
//! `txoutbox_sqs::admin` do for their brokers: a durable queue bound to the configured exchange, for
//! published messages to land somewhere and be counted or cleared.

use lapin::options::{
    QueueBindOptions, QueueDeclareOptions, QueueDeleteOptions, QueuePurgeOptions,
};
use lapin::types::FieldTable;
use lapin::{Channel, Connection};

use txoutbox_core::Error;

use crate::config::AmqpConfig;
use crate::error::map_lapin;
use crate::publisher::{connect_channel, declare_exchange};

/// A durable queue bound to `config.exchange`, declared (with the exchange, when
/// `amqp.declare_exchange` is set) on a connection of its own.
pub struct BoundQueue {
    connection: Connection,
    channel: Channel,
    name: String,
}

impl std::fmt::Debug for BoundQueue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BoundQueue")
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

impl BoundQueue {
    /// Declares the durable queue `name` and binds it to `config.exchange` with `binding_key`
    /// (`#` takes every routing key of a topic exchange).
    ///
    /// # Errors
    /// A connection error, or the broker's refusal (for instance a missing exchange while
    /// `amqp.declare_exchange` is false, or the default exchange, which takes no bindings).
    pub async fn declare(
        config: &AmqpConfig,
        name: &str,
        binding_key: &str,
    ) -> Result<BoundQueue, Error> {
        if config.exchange.is_empty() {
            return Err(Error::config(
                "amqp.exchange is empty (the default exchange): a queue cannot be bound to it; set amqp.exchange",
            ));
        }
        let (connection, channel) = connect_channel(config, "outbox queue tool").await?;
        declare_exchange(config, &channel).await?;
        channel
            .queue_declare(
                name.into(),
                QueueDeclareOptions {
                    durable: true,
                    ..QueueDeclareOptions::default()
                },
                FieldTable::default(),
            )
            .await
            .map_err(|e| map_lapin("declare queue", e))?;
        channel
            .queue_bind(
                name.into(),
                config.exchange.as_str().into(),
                binding_key.into(),
                QueueBindOptions::default(),
                FieldTable::default(),
            )
            .await
            .map_err(|e| map_lapin("bind queue", e))?;
        Ok(BoundQueue {
            connection,
            channel,
            name: name.to_string(),
        })
    }

    /// The queue's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Removes every message from the queue; returns how many there were.
    ///
    /// # Errors
    /// A connection error or the broker's refusal.
    pub async fn purge(&self) -> Result<u32, Error> {
        self.channel
            .queue_purge(self.name.as_str().into(), QueuePurgeOptions::default())
            .await
            .map_err(|e| map_lapin("purge queue", e))
    }

    /// Deletes the queue (with its messages) and closes the connection.
    ///
    /// # Errors
    /// A connection error or the broker's refusal.
    pub async fn delete(self) -> Result<(), Error> {
        self.channel
            .queue_delete(self.name.as_str().into(), QueueDeleteOptions::default())
            .await
            .map_err(|e| map_lapin("delete queue", e))?;
        let _ = self.connection.close(200, "done".into()).await;
        Ok(())
    }
}
