//! Queue names resolved to URLs: once, then remembered in a bounded cache, and forgotten when SQS
//! says the queue does not exist.

use std::sync::Mutex;

use txoutbox_core::cache::BoundedCache;
use txoutbox_core::Error;

use super::SqsPublisher;
use crate::error::{self, map_sdk};

impl SqsPublisher {
    /// Remembers at most `capacity` resolved queue URLs (default
    /// [`txoutbox_core::cache::DEFAULT_DESTINATION_CACHE`]); the least recently used is resolved again
    /// when next needed.
    pub fn with_queue_url_cache(self, capacity: usize) -> Self {
        SqsPublisher {
            urls: Mutex::new(BoundedCache::new(capacity)),
            ..self
        }
    }

    /// How many queue URLs are remembered now.
    pub fn cached_queue_urls(&self) -> usize {
        self.urls.lock().map_or(0, |m| m.len())
    }

    /// The URL of a queue given by URL or name (names resolved once, then cached).
    ///
    /// # Errors
    /// A permanent `destination_not_found` error when the queue does not exist.
    pub async fn queue_url(&self, queue: &str) -> Result<String, Error> {
        if queue.starts_with("https://") || queue.starts_with("http://") {
            return Ok(queue.to_string());
        }
        if let Some(url) = self
            .urls
            .lock()
            .ok()
            .and_then(|mut m| m.get(&queue.to_string()))
        {
            return Ok(url);
        }
        let out = self
            .client
            .get_queue_url()
            .queue_name(queue)
            .send()
            .await
            .map_err(|e| map_sdk("GetQueueUrl", e).with_context("queue", queue))?;
        let url = out.queue_url().unwrap_or_default().to_string();
        if url.is_empty() {
            return Err(error::no_queue_url(queue));
        }
        if let Ok(mut m) = self.urls.lock() {
            m.insert(queue.to_string(), url.clone());
        }
        Ok(url)
    }

    /// Forgets the queue at `queue_url` (it no longer exists): its name is resolved again.
    pub(super) fn forget(&self, queue_url: &str) {
        if let Ok(mut m) = self.urls.lock() {
            m.retain(|_, v| v != queue_url);
        }
    }
}
